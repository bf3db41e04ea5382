"""Building an engine's parts from its config: load, calibrate fp8 KV scales, profile activations, size
the cache and the batch, allocate, capture."""
