"""Benchmarks: pdserve measured side by side with its peers (`pdserve bench`)."""
