"""Prefill node: computes prompts' KV caches in batches, returns each first token at once and
pushes the pages to the decode node named in the request."""
