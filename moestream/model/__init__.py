"""transformers integration: the architecture table, the streaming experts module and the loader."""
