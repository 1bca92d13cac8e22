"""rlhf-kernels: kernels and parallelism primitives for long-context RLHF.

Public names are re-exported lazily so ``import rlhf_kernels`` stays cheap (Triton, transformers
and torch.distributed pieces load on first use).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # packing
    "PackedBatch": "rlhf_kernels.packing",
    "pack_sequences": "rlhf_kernels.packing",
    "plan_micro_batches": "rlhf_kernels.packing",
    "unpad_input": "rlhf_kernels.padding",
    "pad_input": "rlhf_kernels.padding",
    "index_first_axis": "rlhf_kernels.padding",
    "index_put_first_axis": "rlhf_kernels.padding",
    "sequence_to_tokens": "rlhf_kernels.padding",
    # attention
    "varlen_attention": "rlhf_kernels.ops.varlen_attention",
    "flash_attn_varlen_func": "rlhf_kernels.ops.flash_compat",
    "flash_attn_func": "rlhf_kernels.ops.flash_compat",
    # RL math
    "logprobs_from_logits": "rlhf_kernels.ops.logprobs",
    "linear_logprobs": "rlhf_kernels.ops.linear_logprobs",
    "linear_nll_loss": "rlhf_kernels.ops.linear_logprobs",
    "linear_policy_loss": "rlhf_kernels.ops.linear_logprobs",
    "FusedLinearCrossEntropyLoss": "rlhf_kernels.ops.fused_linear_ce",
    "fused_linear_cross_entropy": "rlhf_kernels.ops.fused_linear_ce",
    "CrossEntropyOutput": "rlhf_kernels.ops.fused_linear_ce",
    "gae": "rlhf_kernels.ops.gae",
    "discounted_returns": "rlhf_kernels.ops.gae",
    "group_advantages": "rlhf_kernels.ops.advantages",
    "whiten": "rlhf_kernels.ops.advantages",
    "kl_penalty": "rlhf_kernels.ops.losses",
    "policy_loss": "rlhf_kernels.ops.losses",
    "value_loss": "rlhf_kernels.ops.losses",
    # ring attention
    "RingPlan": "rlhf_kernels.ring.plan",
    "ring_varlen_attention": "rlhf_kernels.ring.attention",
    "gather_from_ring": "rlhf_kernels.ring.gather",
    "ring_token_mean": "rlhf_kernels.ring.gather",
    # rollout distribution
    "broadcast_chunked": "rlhf_kernels.comm.broadcast",
    "scatter_for_ring": "rlhf_kernels.comm.broadcast",
    "distributed_rollouts": "rlhf_kernels.comm.distributed",
    "local_share": "rlhf_kernels.comm.distributed",
}

__all__ = sorted(_EXPORTS) + ["has_native_ext", "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlhf_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


def has_native_ext() -> bool:
    """True when the C++/CUDA extension ``rlhf_kernels._C`` (built from csrc/) is importable."""
    try:
        importlib.import_module("rlhf_kernels._C")
    except ImportError:
        return False
    return True
