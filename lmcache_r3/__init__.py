"""lmcache_r3: routed experts (R3) and KV cache together in one LMCache multiprocess server."""

__version__ = "0.1.0"
