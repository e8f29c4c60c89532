"""Loading a model for streaming, the generation loop, sampling and per-request statistics."""
