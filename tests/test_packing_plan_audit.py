"""Audit of packing.py and ring/plan.py: input checks, and plan facts a regression could break
unnoticed (the L2 bound at exactly half the budget, group totals balanced to the token)."""

import numpy as np
import pytest
import torch

from rlhf_kernels import packing
from rlhf_kernels.packing import pack_sequences, plan_micro_batches
from rlhf_kernels.ring.plan import RingPlan


def test_pack_sequences_refuses_bool_token_ids():
    # a bool tensor (a mask passed by mistake) is not token ids: it was packed as ids 0 / 1
    with pytest.raises(TypeError, match=r"seqs\[1\] must hold integer token ids, got torch.bool"):
        pack_sequences([torch.tensor([3, 4]), torch.tensor([True, False])])


def test_unpack_refuses_a_non_tensor_with_a_clear_error():
    packed = pack_sequences([torch.tensor([3, 4]), torch.tensor([5])])
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        packed.unpack([1, 2, 3])  # was AttributeError: 'list' object has no attribute 'dim'


def test_plan_takes_numpy_ints_for_budget_and_groups():
    """Lengths may be NumPy ints; the budget and group count may too (they were refused as not
    'a positive int', naming the positive int given)."""
    lens = np.array([6, 5, 4, 5])
    expect = plan_micro_batches(lens.tolist(), 10, 2)
    assert plan_micro_batches(lens, np.int64(10), np.int32(2)) == expect
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got np.int64.0."):
        plan_micro_batches(lens, np.int64(0))
    for bad in (10.0, np.float64(10), True):
        with pytest.raises(ValueError, match="max_tokens must be a positive int"):
            plan_micro_batches(lens, bad)
    with pytest.raises(ValueError, match="num_groups must be an int >= 1"):
        plan_micro_batches(lens, 10, 2.0)


@pytest.mark.parametrize(
    "lens, budget, bound",
    [([5, 5], 10, 1), ([1, 2, 2, 3], 4, 2), ([5, 5, 5, 5, 6], 10, 3), ([2, 2, 2], 4, 2)],
)
def test_lower_bound_counts_half_budget_samples_as_small(lens, budget, bound):
    """Two samples of exactly max_tokens / 2 share a micro-batch: the L2 bound must not give each
    its own (a bound above the optimum stops the search early, with a worse plan)."""
    assert packing._lower_bound(lens, budget) == bound
    assert len(plan_micro_batches(lens, budget)[0]) == bound


@pytest.mark.parametrize(
    "lens, budget, groups, totals",
    [
        ([4, 1, 3], 5, 2, [4, 4]),  # a gap of 2 that moving one 1-token sample closes
        ([0, 2, 2, 1, 1], 3, 3, [2, 2, 2]),
        ([3, 2, 4, 2, 1], 7, 3, [4, 4, 4]),
        # the gap lies between a middle group and the lightest (not the heaviest one)
        ([0, 1, 2, 3, 0, 1], 7, 3, [2, 2, 3]),
        ([1, 0, 3, 0, 2, 0, 0, 0], 3, 3, [1, 2, 3]),
        ([2, 1, 1, 0, 0, 0], 2, 3, [1, 1, 2]),
    ],
)
def test_group_totals_balanced_to_the_token(lens, budget, groups, totals):
    """Small cases where the best balance is known: every move / swap that narrows a gap between
    two groups is made, whichever two groups they are."""
    plan = plan_micro_batches(lens, budget, groups)
    assert sorted(sum(lens[i] for b in g for i in b) for g in plan) == totals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_next_token_labels_refuses_non_integer_labels(dtype):
    """Float labels were truncated to ints (2.7 -> 2) and bool ones became 0 / 1, silently."""
    plan = RingPlan.build([0, 3, 5], 2)
    with pytest.raises(TypeError, match=f"labels must hold integer token ids, got {dtype}"):
        plan.next_token_labels(torch.ones(5, dtype=dtype))
    with pytest.raises(TypeError, match="labels must hold integer"):
        plan.next_token_labels(torch.ones(1, 5, dtype=dtype), 0)
    ids = torch.tensor([7, 8, 9, 10, 11], dtype=torch.int32)  # any integer dtype still works
    assert plan.next_token_labels(ids).tolist() == [8, 9, -100, 11, -100]
