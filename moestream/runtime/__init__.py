"""Expert compute and the read/compute overlap scheduler."""
