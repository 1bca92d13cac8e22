"""Contracts of the input checks (``_checks``), the Triton attention's host-side rules (block
sizes, head sections, GQA split, mask meta, launch checks) and the ring self-check's verdict,
ring groups and exit status. Pinned directly, with tiny or no kernel launches."""

from __future__ import annotations

import contextlib
import socket
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf_kernels import _checks
from rlhf_kernels._checks import (
    as_cu_seqlens,
    check_cu_seqlens,
    check_mask,
    device_guard,
    forget_validated,
    is_real,
    is_scalar,
    remember_validated,
    sequence_ids,
)
from rlhf_kernels.ops import varlen_attention_triton as vt
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
from rlhf_kernels.ring import selfcheck

MIB = 1 << 20


def _i32(*vals):
    return torch.tensor(vals, dtype=torch.int32)


@pytest.fixture
def as_cuda(monkeypatch):
    """Every tensor goes through the validation cache (as on CUDA), with an empty cache."""
    monkeypatch.setattr(_checks, "_read_every_time", lambda t: False)
    monkeypatch.setattr(_checks, "_VALIDATED", {})
    return _checks


# ----------------------------------------------------------------------------- _checks
@pytest.mark.parametrize("cu", [torch.zeros(0, dtype=torch.int32), torch.tensor(0)])
def test_cu_seqlens_empty_or_0d_named(cu):
    with pytest.raises(ValueError, match="1-D with at least one entry"):
        check_cu_seqlens(cu, 0)


def test_cu_seqlens_every_adjacent_pair_checked():
    # the first pair too: cu[0] == 0 alone does not stop a negative cu[1]
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\]=-2 < cu_seqlens\[0\]=0"):
        check_cu_seqlens(_i32(0, -2, 5), 5)
    assert check_cu_seqlens(_i32(0, 0, 5, 5), 5) == [0, 0, 5, 5]  # empty sequences pass


def test_cache_entry_of_another_tensor_is_ignored(as_cuda, monkeypatch):
    # same id, version and pointer, but the weakref names another (dead id reused) tensor
    bad, other = _i32(0, 9, 7), _i32(0, 7)
    stale = (weakref.ref(other), bad._version, bad.data_ptr(), [0, 7])
    monkeypatch.setitem(as_cuda._VALIDATED, id(bad), stale)
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(bad, 7)


def test_cache_is_bounded(as_cuda):
    keep = [_i32(0, i) for i in range(3 * as_cuda._CACHE_SIZE)]
    for t in keep:
        remember_validated(t, t.tolist())
    assert 0 < len(as_cuda._VALIDATED) <= as_cuda._CACHE_SIZE


def test_forget_validated_forces_a_read(as_cuda):
    cu = _i32(0, 3, 7)
    assert check_cu_seqlens(cu, 7) == [0, 3, 7]
    cu.numpy()[1] = 9  # no version bump: the cache would still hold [0, 3, 7]
    forget_validated(cu, None)
    assert id(cu) not in as_cuda._VALIDATED
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(cu, 7)


def test_sequence_ids_follow_the_lengths():
    assert sequence_ids(_i32(0, 2, 2, 5), 5).tolist() == [0, 0, 2, 2, 2]


def test_is_real_and_is_scalar():
    assert is_real(np.float32(1.5)) and is_real(3) and not is_real(True)
    assert not is_real(float("inf"), finite=True) and not is_real(0, positive=True)
    assert is_scalar(torch.tensor(2.0)) and is_scalar(0.5)
    assert not is_scalar(torch.ones(1)) and not is_scalar(torch.tensor(True))
    assert not is_scalar(torch.tensor(1j))


def test_device_guard_targets_the_tensors_device():
    # torch.cuda.device only records the index until entered: no GPU needed
    guard = device_guard(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(device_guard(torch.zeros(1)), contextlib.nullcontext)


def test_as_cu_seqlens_builds_int32_on_the_given_device():
    for given in ([0, 3, 5], (0, 3, 5)):
        cu = as_cu_seqlens(given, torch.device("meta"))
        assert cu.device.type == "meta" and cu.dtype == torch.int32 and cu.shape == (3,)
    t = _i32(0, 1)
    assert as_cu_seqlens(t, torch.device("meta")) is t and as_cu_seqlens(None, "cpu") is None


def test_check_mask_rejects_complex_and_non_tensors():
    with pytest.raises(TypeError, match="bool or real numeric"):
        check_mask(torch.tensor([1 + 0j, 0j]))
    with pytest.raises(TypeError, match="mask must be a tensor, got list"):
        check_mask([1, 0])


# ----------------------------------------------------------------------------- block sizes
# (kernel, head_dim, dtype, tokens) -> blocks, on CUDA (the module docstring's rule)
_BF, _F32 = torch.bfloat16, torch.float32
BLOCKS = [
    ("fwd", 64, _BF, 0, (128, 64, 8, 3)),
    ("fwd", 40, _BF, 0, (128, 64, 8, 3)),  # padded to 64
    ("fwd", 128, _BF, 0, (128, 128, 8, 3)),
    ("fwd", 256, _BF, 0, (64, 32, 8, 2)),
    ("fwd", 64, _F32, 0, (128, 64, 8, 3)),
    ("fwd", 128, _F32, 0, (64, 64, 8, 3)),  # fp32 at BLOCK_D >= 128: halved
    ("fwd", 256, _F32, 0, (32, 16, 8, 2)),
    ("dkdv", 64, _BF, (1 << 16) - 1, (64, 64, 4, 3)),
    ("dkdv", 64, _BF, 1 << 16, (128, 128, 8, 3)),  # from 64k tokens
    ("dq", 64, _BF, 0, (128, 128, 8, 3)),  # dQ at every size
    ("dq", 64, _F32, 0, (64, 64, 4, 3)),
    ("dq", 32, torch.float16, 0, (64, 64, 4, 3)),  # narrower heads keep 64 x 64
    ("dkdv", 128, _BF, 0, (64, 64, 4, 2)),
    ("dq", 128, _F32, 0, (32, 32, 4, 2)),
    ("dkdv", 256, _BF, 0, (32, 32, 4, 2)),
    ("dkdv", 256, _F32, 0, (16, 16, 4, 2)),
]


def test_block_sizes_rule(monkeypatch):
    monkeypatch.setattr(vt, "_interpreting", lambda: False)
    got = {c[:4]: vt._block_sizes(*c[1:3], c[0], c[3]) for c in BLOCKS}
    assert got == {c[:4]: c[4] for c in BLOCKS}
    with pytest.raises(ValueError, match="kernel must be 'fwd', 'dkdv' or 'dq', got 'bwd'"):
        vt._block_sizes(64, _BF, "bwd")
    monkeypatch.setattr(vt, "_interpreting", lambda: True)
    assert vt._block_sizes(256, _F32, "dkdv", 1 << 20) == (16, 16, 1, 1)


def test_block_d_pads_to_a_power_of_two_of_at_least_16():
    dims = {1: 16, 8: 16, 16: 16, 17: 32, 40: 64, 64: 64, 65: 128, 128: 128, 256: 256}
    assert {d: vt._block_d(d) for d in dims} == dims


def test_dot_meta_f32_dots_only_for_interpreted_bf16(monkeypatch):
    monkeypatch.setattr(vt, "_interpreting", lambda: True)
    assert vt._dot_meta(_BF) == dict(DOT_PREC="ieee", DOT_F32=True)
    monkeypatch.setattr(vt, "_interpreting", lambda: False)
    assert vt._dot_meta(_BF) == dict(DOT_PREC="tf32", DOT_F32=False)


# ----------------------------------------------------------------------------- schedule rules
def test_head_section_zero_and_default(monkeypatch):
    monkeypatch.setenv("RLHF_KERNELS_HEAD_SECTION", "0")
    with pytest.raises(ValueError, match="a number of kv heads >= 1, got '0'"):
        vt._head_section(torch.device("cpu"), 16, 2, 0)
    monkeypatch.delenv("RLHF_KERNELS_HEAD_SECTION")  # default: auto, sized by the L2
    monkeypatch.setattr(vt, "_l2_bytes", lambda device: 50 * MIB)
    assert vt._head_section(torch.device("cuda", 0), 32, 1, 32 * MIB) == 1


def test_gqa_split_stops_at_two_programs_per_sm(monkeypatch):
    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    assert vt._gqa_split(132, 1, 8, torch.device("cuda", 0)) == 2  # 264 == 2 * 132: enough
    assert vt._gqa_split(131, 1, 8, torch.device("cuda", 0)) == 4


def test_mask_meta():
    cap = vt._WINDOW_CAP
    assert vt._mask_meta(False, (-1, -1)) == (0, 0, False, False)
    assert vt._mask_meta(True, (-1, 7)) == (0, 0, False, True)  # causal: right side 0
    assert vt._mask_meta(False, (3, cap)) == (3, 0, True, False)
    assert vt._mask_meta(True, (cap - 1, 2)) == (cap - 1, 0, True, True)


# ----------------------------------------------------------------------------- launch checks
def test_triton_launch_checks(monkeypatch):
    q, cu = torch.zeros(4, 1, 16), _i32(0, 4)
    with pytest.raises(ValueError, match="max_seqlen_k=1073741824"):
        vt.triton_varlen_attention(q, q, q, cu, cu, 4, 1 << 30, 0.25, False, (-1, -1), 0.0)
    monkeypatch.setattr(vt.triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="needs CUDA tensors .* got q on cpu"):
        vt.triton_varlen_attention(q, q, q, cu, cu, 4, 4, 0.25, False, (-1, -1), 0.0)


def _qkv(lens, heads=2, kv_heads=1, dim=16):
    g = torch.Generator().manual_seed(0)
    n = sum(lens)
    shapes = ((n, heads, dim), (n, kv_heads, dim), (n, kv_heads, dim))
    return [torch.randn(*s, generator=g, requires_grad=True) for s in shapes], _i32(
        0, *np.cumsum(lens).tolist()
    )


def test_triton_lse_only_backward_matches_the_reference():
    # out unused: its gradient arrives as None and must count as zeros
    (q, k, v), cu = _qkv([5, 11])
    args = (cu, cu, 11, 11, 0.25, True, (-1, -1), 0.0)
    lse = vt.triton_varlen_attention(q, k, v, *args)[1]
    got = torch.autograd.grad(lse.sum(), (q, k, v))
    ref = varlen_attention_reference(q, k, v, cu, cu, 0.25, True, (-1, -1), 0.0)[1]
    for a, b in zip(got, torch.autograd.grad(ref.sum(), (q, k))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not got[2].any()  # lse does not depend on v


def test_triton_non_positive_softcap_is_off():
    (q, k, v), cu = _qkv([5, 11])
    args = (cu, cu, 11, 11, 0.25, False, (-1, -1))
    off = vt.triton_varlen_attention(q, k, v, *args, 0.0)[0]
    torch.testing.assert_close(vt.triton_varlen_attention(q, k, v, *args, -1.0)[0], off)


# ----------------------------------------------------------------------------- ring selfcheck
def test_verdict_tolerance_formula_and_sign():
    g = torch.Generator().manual_seed(0)
    truth = 10 * torch.randn(32, 2, 4, generator=g, dtype=torch.float64)
    single = truth + 1e-3
    ok, (err, ref_err, tol) = selfcheck.verdict(truth - 2e-3, single, truth, torch.float32)
    floor = 64 * torch.finfo(torch.float32).eps * truth.abs().max().item()
    assert tol == pytest.approx(2 * ref_err + floor, rel=1e-12) and ref_err == pytest.approx(1e-3)
    assert ok and err == pytest.approx(2e-3)
    low = truth.clone()
    low[3, 1, 2] -= 0.5  # an error below the truth counts as much as one above
    assert not selfcheck.verdict(low, single, truth, torch.float32)[0]


def test_ring_group_splits_consecutive_ranks(monkeypatch):
    made = []
    fake = SimpleNamespace(
        get_world_size=lambda: 4,
        get_rank=lambda: 2,
        new_group=lambda ranks: made.append(ranks) or f"g{ranks[0]}",
    )
    monkeypatch.setattr(selfcheck, "dist", fake)
    assert selfcheck.ring_group(2) == ("g2", 1)
    assert made == [[0, 1], [2, 3]]  # every rank creates every group (collective)
    assert selfcheck.ring_group(4) == (None, 0)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="ring_size must divide the world size 4"):
            selfcheck.ring_group(bad)


def test_selfcheck_refuses_zero_iters():
    # was an IndexError after the untimed warm-up step (median of no timings)
    with pytest.raises(ValueError, match="iters must be >= 1, got 0"):
        selfcheck.check(1, iters=0)


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo world of this process alone, on the CPU (GPU or not)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    for name, val in env.items():
        monkeypatch.setenv(name, val)
    return ["--total", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]


def test_selfcheck_one_failing_tensor_fails_the_run(world_of_one, monkeypatch, capsys):
    assert selfcheck.main([*world_of_one, "--iters", "1", "--dtype", "fp32"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    real, seen = selfcheck.verdict, []

    def fail_first(ring, single, truth, dtype):  # only the output (checked first) is off
        seen.append(1)
        ok, errs = real(ring, single, truth, dtype)
        return ok and len(seen) > 1, errs

    monkeypatch.setattr(selfcheck, "verdict", fail_first)
    assert selfcheck.main([*world_of_one, "--iters", "1", "--dtype", "fp32"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL: ranks [0] exceed the tolerance")
