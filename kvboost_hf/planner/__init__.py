"""Capacity model (``kvboost-hf plan``): what a model needs and how many sequences a machine can serve."""

from kvboost_hf.models.shape import ModelShape, kv_bytes_per_sequence, kv_bytes_per_token
from kvboost_hf.planner.capacity import CapacityReport, capacity, weight_bytes

__all__ = ["CapacityReport", "ModelShape", "capacity", "kv_bytes_per_sequence", "kv_bytes_per_token", "weight_bytes"]
