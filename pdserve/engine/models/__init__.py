"""Model definitions that run over flat batches and the paged KV cache."""
