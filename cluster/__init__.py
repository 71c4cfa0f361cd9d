"""Cluster-level pieces: the `pdserve` command line and shared process set-up."""
