"""KV caches: the batched engine's row caches (`rows`) and the padded caches of per-session decoding (`padded`)."""
