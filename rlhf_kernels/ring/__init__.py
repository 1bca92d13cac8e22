"""Ring attention (sequence parallelism) over torch.distributed."""

from rlhf_kernels.ring.attention import ring_varlen_attention
from rlhf_kernels.ring.gather import gather_from_ring, ring_token_mean
from rlhf_kernels.ring.plan import RingPlan

__all__ = ["RingPlan", "gather_from_ring", "ring_token_mean", "ring_varlen_attention"]
