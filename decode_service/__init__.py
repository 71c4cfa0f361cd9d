"""Decode node: receives prompts' KV pages, runs the continuous batch, streams tokens."""
