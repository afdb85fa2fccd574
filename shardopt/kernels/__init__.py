"""The AdamW update math: ``reference`` is the readable oracle every faster path is tested against."""
from shardopt.kernels.reference import adamw_update_, round_to_dtype

__all__ = ["adamw_update_", "round_to_dtype"]
