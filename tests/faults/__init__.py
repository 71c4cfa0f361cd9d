"""Fault tests: real clusters on 127.0.0.1, killed, stopped and overloaded on purpose."""
