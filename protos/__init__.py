"""The wire contract between pdserve's processes (package pdserve.v1) and its generated stubs."""
