"""Where expert bytes live: safetensors shards, their headers, and the (layer, expert, kind) -> bytes map."""
