"""Bounded-memory rollout distribution over torch.distributed."""

from .broadcast import broadcast_chunked, scatter_for_ring
from .distributed import distributed_rollouts, local_share

__all__ = ["broadcast_chunked", "distributed_rollouts", "local_share", "scatter_for_ring"]
