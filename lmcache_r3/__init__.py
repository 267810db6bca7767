"""lmcache_r3: routed experts (R3) and KV cache together in one LMCache multiprocess server."""

__version__ = "0.1.0"

from lmcache_r3.output import RoutedExpertsUnavailable, routed_experts, routed_experts_from_params  # noqa: E402

__all__ = ["RoutedExpertsUnavailable", "__version__", "routed_experts", "routed_experts_from_params"]
