"""Triton varlen attention (forward + backward) against the float64 reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), so shapes stay tiny but
cover several 16-wide blocks, uneven and empty sequences, GQA/MQA, odd head dims, masks that skip
whole key blocks, cross-attention lengths (bottom-right alignment, rows that see no key) and
softcap. The ``gpu`` test repeats the comparisons at larger shapes on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlhf_kernels.ops.varlen_attention import varlen_attention, varlen_attention_reference
from rlhf_kernels.ops.varlen_attention_triton import triton_varlen_attention

# (id, lens_q, lens_k (None = self-attention), heads, kv_heads, head_dim, causal, window, softcap)
# Interpreter blocks are 16 x 16; lengths and windows are chosen so that a block is "just"
# partial somewhere (one masked entry), where an off-by-one in a loop bound or in the
# fully-visible-tile shortcut would change the result.
CASES = [
    # 47 = 2 * 16 + 15: the last key block has exactly one padding column
    ("full_mqa_d40", [5, 1, 0, 47], None, 2, 1, 40, False, (-1, -1), 0.0),
    ("causal_gqa_d64", [17, 1, 0, 31], None, 4, 2, 64, True, (-1, -1), 0.0),
    # lq < lk (seq 1: lk - lq = 14, block (0, 0) hides one key from row 0); lq > lk (first rows
    # of seq 2 see nothing); seq 3 has no keys at all
    ("cross_causal_gqa_d24", [7, 18, 20, 4], [12, 32, 3, 0], 4, 2, 24, True, (-1, -1), 0.0),
    # left = 30 (= 14 mod 16): block (32, 16) hides one key from row 47
    ("window_left_causal_softcap_d40", [48, 9], None, 4, 2, 40, True, (30, -1), 1.5),
    # left = right = 1 (mod 16): the first/last key or query a block needs sits just across a
    # 16-wide block edge
    ("window_left_right_gqa_d64", [19, 1, 40], None, 4, 2, 64, False, (17, 1), 0.0),
    # lq = 0 with lk > 0 (those keys get zero grads), lq > lk with a window (empty rows)
    ("cross_window_softcap_mqa_d96", [9, 0, 20], [14, 6, 5], 2, 1, 96, False, (3, 2), 2.0),
    # many short sequences and one long one: the flat schedule has unused slots at its end
    ("skewed_causal_gqa_d32", [1] * 9 + [0, 40, 3], None, 4, 2, 32, True, (-1, -1), 0.0),
]
CASE_IDS = [c[0] for c in CASES]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _problem(lens_q, lens_k, heads, kv_heads, dim, device="cpu"):
    """float64 q, k, v, dout and cu_seqlens for one packed batch."""
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(sum(lens_q), heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), kv_heads, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(sum(lens_q), heads, dim, generator=g, dtype=torch.float64)
    tensors = [t.to(device) for t in (q, k, v, dout)]
    return (*tensors, _cu(lens_q).to(device), _cu(lens_k).to(device), max(lens_q), max(lens_k))


def _run(fn, q, k, v, dout, dtype, **kw):
    """Forward + backward of ``fn`` in ``dtype``: returns [out, lse, dq, dk, dv]."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, **kw)
    out.backward(dout.to(dtype))
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def _triton(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
    return triton_varlen_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap
    )


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
    return varlen_attention_reference(q, k, v, cu_q, cu_k, scale, causal, window, softcap)


def _compare(case, dtype, device="cpu"):
    """Returns ([triton results], [float64 results], [reference-in-dtype results] or None)."""
    _, lens_q, lens_k, heads, kv_heads, dim, causal, window, softcap = case
    q, k, v, dout, cu_q, cu_k, max_q, max_k = _problem(lens_q, lens_k, heads, kv_heads, dim, device)
    kw = dict(
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=max_q,
        max_k=max_k,
        scale=dim**-0.5,
        causal=causal,
        window=window,
        softcap=softcap,
    )
    got = _run(_triton, q, k, v, dout, dtype, **kw)
    ref = _run(_reference, q, k, v, dout, torch.float64, **kw)
    low = None if dtype == torch.float32 else _run(_reference, q, k, v, dout, dtype, **kw)
    return got, ref, low


NAMES = ["out", "lse", "dq", "dk", "dv"]


def _check_structure(got, ref):
    for name, a, r in zip(NAMES, got, ref):
        assert a.shape == r.shape, name
        assert not torch.isnan(a).any(), f"{name} has NaN"
    # rows that see no key: lse -inf exactly where the reference has it, output and dq zero
    empty = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(got[1]), empty)
    assert torch.isfinite(got[1][~empty]).all()
    rows = empty.t()  # (total_q, H)
    assert (got[0][rows] == 0).all() and (got[2][rows] == 0).all()


def _max_err(a, r, name):
    if name == "lse":
        keep = torch.isfinite(r)
        a, r = a[keep], r[keep]
    return (a.double() - r).abs().max().item() if r.numel() else 0.0


def _check(case, dtype, device="cpu", fp32_tol=1e-5):
    """fp32: close to float64. fp16/bf16: error <= 2 x error of the reference math run in that
    dtype (both vs float64) plus a tiny absolute floor."""
    got, ref, low = _compare(case, dtype, device)
    _check_structure(got, ref)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(t.dtype == dtype for t in got[2:])
    for i, (name, a, r) in enumerate(zip(NAMES, got, ref)):
        keep = torch.isfinite(r)
        if dtype == torch.float32:
            torch.testing.assert_close(
                a.double()[keep], r[keep], rtol=fp32_tol, atol=fp32_tol, msg=f"{case[0]} {name}"
            )
            continue
        err, torch_err = _max_err(a, r, name), _max_err(low[i], r, name)
        floor = 1e-4 * r[keep].abs().max().item()
        assert err <= 2 * torch_err + floor, (case[0], name, err, torch_err)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp32_matches_float64_reference(case):
    _check(case, torch.float32)


@pytest.mark.parametrize(
    "dtype,case",
    [(torch.float16, CASES[2]), (torch.bfloat16, CASES[3]), (torch.bfloat16, CASES[5])],
    ids=["fp16-" + CASES[2][0], "bf16-" + CASES[3][0], "bf16-" + CASES[5][0]],
)
def test_low_precision_within_2x_of_torch(dtype, case):
    _check(case, dtype)


def test_public_api_matches_torch_backend_and_is_deterministic():
    lens = [21, 1, 0, 12]
    q, k, v, dout, cu_q, cu_k, _, _ = _problem(lens, None, 4, 2, 40)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    # max_seqlen_* larger than needed: the extra programs must exit without writing
    kw = dict(
        max_seqlen_q=40,
        max_seqlen_k=37,
        softmax_scale=0.3,
        causal=True,
        window_size=[7, -1],
        softcap=3.0,
        return_lse=True,
    )
    dlse = torch.randn(q.shape[1], q.shape[0])  # causal self-attention: every lse is finite
    results = []
    for backend in ("triton", "triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = varlen_attention(*leaves, cu_q.long(), cu_k.long(), backend=backend, **kw)
        torch.autograd.backward([out, lse], [dout, dlse])  # the lse is differentiable too
        results.append([out, lse] + [t.grad for t in leaves])
    for a, b in zip(results[0], results[1]):  # no atomics: bit-identical reruns
        assert torch.equal(a, b)
    for name, a, b in zip(NAMES, results[0], results[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_partials_merged_by_their_lse_have_exact_gradients(backend):
    """Each sequence's keys in two halves, attended apart and merged by their lse, equal full
    attention, gradients included (the triton lse had no gradient: dq/dk off by 0.3)."""
    lens_q, lens_k = [5, 9, 3], [6, 1, 4]  # the 1-key sequence leaves one half without keys
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g, dtype=torch.float64) for _ in "kv")
    cu_q = _cu(lens_q)
    halves, cus, start = ([], []), ([0], [0]), 0
    for n in lens_k:
        cut = n // 2
        halves[0].extend(range(start, start + cut))
        halves[1].extend(range(start + cut, start + n))
        cus[0].append(cus[0][-1] + cut)
        cus[1].append(cus[1][-1] + n - cut)
        start += n
    w = torch.randn(sum(lens_q), 4, 16, generator=g, dtype=torch.float64)

    def merged(q, k, v):
        parts = [
            varlen_attention(
                q.float(),
                k[h].float(),
                v[h].float(),
                cu_q,
                torch.tensor(cu),
                return_lse=True,
                backend=backend,
            )
            for h, cu in zip(halves, cus)
        ]
        lse = torch.logaddexp(parts[0][1], parts[1][1])  # (H, T)
        return sum(o.double() * (part - lse).exp().double().T[..., None] for o, part in parts)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = merged(*leaves)
    (out * w).sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = varlen_attention_reference(*full, cu_q, _cu(lens_k))  # float64, unsplit
    (ref * w).sum().backward()
    for name, a, r in zip(("out", "dq", "dk", "dv"), [out] + leaves, [ref] + full):
        a, r = (a if name == "out" else a.grad), (r if name == "out" else r.grad)
        torch.testing.assert_close(a, r, rtol=2e-5, atol=2e-5, msg=f"{backend} merge {name}")


def test_rejects_float64():
    q = torch.randn(4, 2, 16, dtype=torch.float64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="fp32/fp16/bf16"):
        triton_varlen_attention(q, q, q, cu, cu, 4, 4, 0.25, False, (-1, -1), 0.0)
    with pytest.raises(TypeError, match="float64"):
        varlen_attention(q, q, q, cu, cu, backend="triton")


_AOT_SCRIPT = textwrap.dedent(
    """
    import inspect, json, os, re, subprocess, tempfile, torch, triton
    from triton.backends.compiler import GPUTarget
    from rlhf_kernels.ops import varlen_attention_triton as m
    DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    DATA = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")
    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    stack = {}
    for dt, dim in (("fp16", 128), ("bf16", 64), ("bf16", 128), ("fp32", 256)):
        for kern in (m._fwd_kernel, m._bwd_dkdv_kernel, m._bwd_dq_kernel, m._bwd_delta_kernel):
            names = list(inspect.signature(kern.fn).parameters)
            kind = {"_fwd_kernel": "fwd", "_bwd_dkdv_kernel": "dkdv"}.get(kern.fn.__name__, "dq")
            bm, bn, warps, stages = m._block_sizes(dim, DTYPES[dt], kind)
            const = dict(GROUP=2, HAS_LEFT=True, HAS_RIGHT=True, SOFTCAP=True, BLOCK_M=bm,
                         BLOCK_N=bn, BLOCK_D=dim, BLOCK_T=64, HAS_DIFF=dt != "fp16", SPLIT=1,
                         **m._dot_meta(DTYPES[dt]))
            const = {n: v for n, v in const.items() if n in names}
            sig = {}
            for n in names:
                sig[n] = ("constexpr" if n in const else "*" + dt if n in DATA
                          else "*fp32" if n in ("LSE", "DELTA")
                          else "*i32" if n.startswith("CU_") or n in ("DIFF", "SCHED")
                          else "fp32" if n in ("scale", "softcap") else "i32")
            src = triton.compiler.ASTSource(
                kern, sig, {(names.index(n),): v for n, v in const.items()})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=stages))
            assert k.metadata.shared <= 227 * 1024, (kern.__name__, dt, k.metadata.shared)
            if os.path.exists(CUOBJDUMP):  # register spills: the STACK bytes of the cubin
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"]); f.flush()
                    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name],
                                         capture_output=True, text=True).stdout
                stack[f"{kern.fn.__name__} {dt} {dim}"] = int(re.search(r"STACK:(\\d+)", res)[1])
    # head_dim 64 dK/dV of a large pack: its own (128 x 128, 8 warps) default blocks
    kern, names = m._bwd_dkdv_kernel, list(inspect.signature(m._bwd_dkdv_kernel.fn).parameters)
    bm, bn, warps, stages = m._block_sizes(64, torch.bfloat16, "dkdv", 1 << 17)
    const = dict(GROUP=2, HAS_LEFT=True, HAS_RIGHT=True, SOFTCAP=True, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_D=64, HAS_DIFF=True, SPLIT=1, **m._dot_meta(torch.bfloat16))
    sig = {n: ("constexpr" if n in const else "*bf16" if n in DATA else "*fp32"
               if n in ("LSE", "DELTA") else "*i32" if n.startswith("CU_") or n in ("DIFF", "SCHED")
               else "fp32" if n in ("scale", "softcap") else "i32") for n in names}
    k = triton.compile(triton.compiler.ASTSource(kern, sig, {(names.index(n),): v
                       for n, v in const.items()}), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    assert k.metadata.shared <= 227 * 1024, ("dkdv bf16 64 large", k.metadata.shared)
    from rlhf_kernels.ops.attention_schedule import _schedule_kernel
    for by_keys in (False, True):
        const = dict(BY_KEYS=by_keys, HAS_DIFF=True, HAS_LEFT=True, HAS_RIGHT=True,
                     BLOCK_S=128, BLOCK_B=64)
        names = list(inspect.signature(_schedule_kernel.fn).parameters)
        sig = {n: "constexpr" if n in const else "*i32" if n.isupper() else "i32" for n in names}
        src = triton.compiler.ASTSource(
            _schedule_kernel, sig, {(names.index(n),): v for n, v in const.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    print("compiled", json.dumps(stack))
    """
)

# Spill bytes (STACK of the sm_90 cubin, Triton 3.9.0's ptxas) of the builds above (both window
# sides, softcap, GQA 2). 64-bit bases once per block with 32-bit offsets for the tiles a program
# keeps across its loop brought them down from (fwd / dkdv / dq) bf16 d64 0 / 216 / 0 B,
# bf16 d128 552 / 1184 / 736 B, fp16 d128 552 / 1232 / 736 B, fp32 d256 0 / 4544 / 320 B.
# Head sections (``_program``'s two runtime divisions) moved dkdv d128 by +8 B (bf16), -16 (fp16).
_SPILLS = {
    "_fwd_kernel bf16 64": 0,
    "_bwd_dkdv_kernel bf16 64": 8,
    "_bwd_dq_kernel bf16 64": 0,
    "_fwd_kernel bf16 128": 408,
    "_bwd_dkdv_kernel bf16 128": 680,
    "_bwd_dq_kernel bf16 128": 256,
    "_fwd_kernel fp16 128": 408,
    "_bwd_dkdv_kernel fp16 128": 672,
    "_bwd_dq_kernel fp16 128": 256,
    "_bwd_dkdv_kernel fp32 256": 4424,
    "_bwd_dq_kernel fp32 256": 0,
}


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Lower every kernel to an H100 cubin without a GPU (catches GPU-only compile errors that
    the interpreter accepts, and shared-memory overflows of the chosen block sizes), and pin the
    register spills of the bf16/fp16 builds (Triton 3.9.0's ptxas)."""
    pytest.importorskip("triton.backends.nvidia")
    import json

    import triton

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    if "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("ptxas not available")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
    stack = json.loads(res.stdout.split("compiled", 1)[1])
    if triton.__version__ == "3.9.0" and stack:
        worse = {k: (stack[k], v) for k, v in _SPILLS.items() if stack[k] > v}
        assert not worse, f"more register spills than pinned (got, pinned): {worse}"


# (cases at CUDA scale: several 128-wide blocks, long and empty sequences, windows that skip blocks)
def _cuda_cases(dim):
    return [
        ("causal", [1000, 1, 0, 2047, 513], None, 8, 2, dim, True, (-1, -1), 0.0),
        ("cross_window_softcap", [300, 7, 900], [900, 0, 700], 8, 1, dim, False, (128, 64), 30.0),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_cuda_larger_shapes(dtype, dim):
    for case in _cuda_cases(dim):
        _check(case, dtype, device="cuda", fp32_tol=2e-5)


def _tf32(flag: bool):
    """Set torch's TF32 matmul flag; returns the old value (cuBLASModule is not monkeypatchable)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = flag
    return old


def test_fp32_dot_precision_follows_torch_tf32_flag():
    from rlhf_kernels.ops import varlen_attention_triton as vt

    old = _tf32(False)
    try:
        assert vt._dot_meta(torch.float32)["DOT_PREC"] == "ieee"
        _tf32(True)
        assert vt._dot_meta(torch.float32)["DOT_PREC"] == "tf32"
        assert vt._dot_meta(torch.float16)["DOT_PREC"] == "tf32"  # tensor-core dots either way
    finally:
        _tf32(old)


@pytest.mark.gpu
def test_cuda_fp32_exact_by_default_tf32_on_request():
    """Compiled fp32: exact products by default (error ~1e-6), TF32 when torch allows it."""
    case = ("causal", [300, 200], None, 4, 2, 64, True, (-1, -1), 0.0)
    old = _tf32(False)
    try:
        got, ref, _ = _compare(case, torch.float32, device="cuda")
        exact = max(_max_err(a, r, n) for a, r, n in zip(got, ref, NAMES))
        _tf32(True)
        got, ref, _ = _compare(case, torch.float32, device="cuda")
        tf32 = max(_max_err(a, r, n) for a, r, n in zip(got, ref, NAMES))
    finally:
        _tf32(old)
    assert exact < 2e-5 < tf32 < 5e-2, (exact, tf32)


# ----------------------------------------------------------------------------- schedule, GQA split
def _blocks_brute(lens_q, lens_k, diff, block, by_keys, left, right):
    """{(b, blk): visible partner rows} by enumerating every (query, key) pair."""
    out = {}
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        d = lk - lq if diff is None else diff[b]
        n = lk if by_keys else lq
        for blk in range(-(-n // block)):
            rows = range(blk * block, min(blk * block + block, n))
            partners = set()
            for r in rows:
                for p in range(lq if by_keys else lk):
                    i, j = (p, r) if by_keys else (r, p)
                    if (left < 0 or j >= i + d - left) and (right < 0 or j <= i + d + right):
                        partners.add(p)
            # the kernels' range is [first visible, last visible] of the whole block
            out[(b, blk)] = (max(partners) - min(partners) + 1) if partners else 0
    return out


@pytest.mark.parametrize("by_keys", [False, True], ids=["query_blocks", "key_blocks"])
@pytest.mark.parametrize(
    "lens_q, lens_k, diff, window",
    [
        ([1] * 9 + [0, 70, 3], None, None, (-1, 0)),  # skewed causal self-attention
        ([7, 18, 20, 4], [12, 32, 3, 0], None, (5, 2)),  # cross lengths, two-sided window
        ([16, 16, 9], [40, 16, 33], [24, -3, 0], (-1, 0)),  # ring tiles: explicit key offsets
    ],
)
@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_flat_schedule_holds_every_block_once_heaviest_first(
    lens_q, lens_k, diff, window, by_keys, impl
):
    from rlhf_kernels.ops import attention_schedule as sch
    from rlhf_kernels.ops import varlen_attention_triton as vt

    lens_k = lens_q if lens_k is None else lens_k
    block = 16
    dt = None if diff is None else torch.tensor(diff, dtype=torch.int32)
    mask = vt._mask_meta(False, window)
    n = sum(lens_k if by_keys else lens_q)
    slots = sch.schedule_slots(n, len(lens_q), max(lens_k if by_keys else lens_q), block)
    build = sch.flat_schedule if impl == "kernel" else sch.flat_schedule_reference
    table = build(_cu(lens_q), _cu(lens_k), dt, block, by_keys, mask, slots)
    want = _blocks_brute(lens_q, lens_k, diff, block, by_keys, *window)
    assert table.dtype == torch.int32 and table.shape == (slots, 2)
    used = [tuple(r) for r in table.tolist() if r[0] >= 0]
    assert sorted(used) == sorted(want) and len(set(used)) == len(used)
    assert all(r == [-1, 0] for r in table[len(used) :].tolist())  # unused slots last
    work = [want[e] for e in used]
    assert work == sorted(work, reverse=True), work
    # never more programs than the rectangular (batch, cdiv(max_len, block)) grid of before;
    # with skewed lengths far fewer (18 instead of 60 in the first case)
    rect = len(lens_q) * -(-max(lens_k if by_keys else lens_q) // block)
    assert slots <= rect and (len(lens_q) < 12 or 3 * slots < rect), (slots, rect)


def test_schedule_flat_for_skewed_packs_static_rectangle_for_uniform_ones():
    from rlhf_kernels.ops import attention_schedule as sch
    from rlhf_kernels.ops import varlen_attention_triton as vt

    mask = vt._mask_meta(True, (-1, -1))
    skewed = _cu([1] * 9 + [0, 70, 3])  # 18 flat slots vs a 60-slot rectangle
    table = sch.schedule(skewed, skewed, None, 16, False, mask, 82, 70)
    assert table.shape == (18, 2) and table[0].tolist() == [10, 4]
    uniform = _cu([40, 33, 47])  # 7 flat slots vs a 9-slot rectangle
    table = sch.schedule(uniform, uniform, None, 16, False, mask, 120, 47)
    assert table is sch.schedule(uniform, uniform, None, 16, False, mask, 120, 47)  # cached
    assert table.tolist() == [[b, m] for m in (2, 1, 0) for b in range(3)]


@pytest.mark.parametrize("seed", range(6))
def test_flat_schedule_kernel_matches_the_torch_reference(seed):
    """The one-launch table equals the torch reference row for row (same stable order), on
    random packs wider than one ``BLOCK_B`` chunk of the kernel's batch loop and with more slots
    than one ``BLOCK_S`` program, every mask kind and explicit key offsets."""
    _check_flat_schedule_kernel(seed, "cpu")


@pytest.mark.gpu
def test_cuda_flat_schedule_kernel_matches_the_torch_reference():
    for seed in range(6):
        _check_flat_schedule_kernel(seed, "cuda")


def _check_flat_schedule_kernel(seed, device):
    from rlhf_kernels.ops import attention_schedule as sch
    from rlhf_kernels.ops import varlen_attention_triton as vt

    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 150, (1,), generator=g))
    lens_q = torch.randint(0, 60, (batch,), generator=g)
    lens_q[torch.rand(batch, generator=g) < 0.2] = 0  # empty sequences
    lens_k = lens_q + torch.randint(0, 40, (batch,), generator=g) if seed % 2 else lens_q
    diff = torch.randint(-20, 40, (batch,), generator=g, dtype=torch.int32) if seed >= 4 else None
    window = [(-1, -1), (-1, 0), (7, 3), (-1, 5), (12, -1), (0, 0)][seed]
    for by_keys in (False, True):
        for block in (1, 16):
            lens = lens_k if by_keys else lens_q
            slots = sch.schedule_slots(int(lens.sum()), batch, int(lens.max()), block)
            cu_q, cu_k = (_cu(x.tolist()).to(device) for x in (lens_q, lens_k))
            d = None if diff is None else diff.to(device)
            args = (cu_q, cu_k, d, block, by_keys, vt._mask_meta(False, window), slots)
            want = sch.flat_schedule_reference(*args)
            assert torch.equal(sch.flat_schedule(*args), want), (by_keys, block)


@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 1, 0), (2**31 - 40, 3)])
def test_window_sides_past_int32_token_math_are_unbounded(window):
    """Window sides near 2**31 wrapped in the kernels' int32 index math (out 2.6 off the
    reference at (0, 2**31 - 1)) and reordered the schedule; they hide nothing, so they now
    run as unbounded sides."""
    g = torch.Generator().manual_seed(0)
    cu = _cu([40, 20])
    q, k, v = (torch.randn(60, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    out = varlen_attention(q, k, v, cu, cu, window_size=window, backend="triton")
    want = varlen_attention(q, k, v, cu, cu, window_size=window, backend="torch")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_triton_refuses_sequences_past_its_window_cap():
    q = torch.zeros(4, 1, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="shorter than 2\\*\\*30 tokens"):
        triton_varlen_attention(q, q, q, cu, cu, 2**30, 4, 0.25, False, (-1, -1), 0.0)


def test_cu_seqlens_rewritten_without_a_version_bump_is_followed():
    """The schedule is rebuilt at every launch: ``cu_seqlens`` rewritten in place through a
    path that does not bump the tensor's version (here a NumPy alias; collectives into a
    buffer and ``.data`` do the same) gives the new pack's results, not the old table's
    (a per-pack cache keyed on the version returned garbage rows here)."""
    lens_a, lens_b = [5, 40, 3], [40, 5, 3]  # same total and longest
    q, k, v, dout, cu, _, _, _ = _problem(lens_a, None, 2, 1, 16)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    args = (q32, k32, v32)
    first = triton_varlen_attention(*args, cu, cu, 40, 40, 0.25, True, (-1, -1), 0.0)[0]
    version = cu._version
    cu.numpy()[:] = _cu(lens_b).numpy()
    assert cu._version == version and cu.tolist() == [0, 40, 45, 48]
    got = triton_varlen_attention(*args, cu, cu, 40, 40, 0.25, True, (-1, -1), 0.0)[0]
    want = varlen_attention_reference(*args, cu, cu, 0.25, True, (-1, -1), 0.0)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first, got)


@pytest.mark.parametrize("split", [2, 4])
def test_gqa_split_dkdv_matches_float64_reference(split):
    """dK/dV with the GQA group split across programs (fp32 partials) equal the float64
    reference as closely as the unsplit launch does."""
    from rlhf_kernels.ops.varlen_attention_triton import (
        varlen_attention_triton_backward,
        varlen_attention_triton_forward,
    )

    q, k, v, dout, cu_q, cu_k, max_q, max_k = _problem([19, 0, 33], None, 8, 2, 40)
    args = (cu_q, cu_k, max_q, max_k, 40**-0.5, True, (-1, -1), 1.5)
    ref = _run(_reference, q, k, v, dout, torch.float64, cu_q=cu_q, cu_k=cu_k, max_q=max_q,
               max_k=max_k, scale=40**-0.5, causal=True, window=(-1, -1), softcap=1.5)  # fmt: skip
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, dout))
    out, lse = varlen_attention_triton_forward(q32, k32, v32, *args)
    errs = {}
    for s in (1, split):
        dq, dk, dv = varlen_attention_triton_backward(do32, q32, k32, v32, out, lse, *args,
                                                      gqa_split=s)  # fmt: skip
        errs[s] = [(a.double() - r).abs().max().item() for a, r in zip((dq, dk, dv), ref[2:])]
    assert max(errs[split]) < 1e-5 and max(errs[1]) < 1e-5, errs
    for bad in (3, -2):
        with pytest.raises(ValueError, match=f"gqa_split={bad} must be an int >= 1 dividing"):
            varlen_attention_triton_backward(do32, q32, k32, v32, out, lse, *args, gqa_split=bad)


@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
def test_head_sections_change_the_order_not_the_results(window, monkeypatch):
    """Programs in sections of one kv head (``RLHF_KERNELS_HEAD_SECTION=1``) give bit-identical
    outputs, lse and gradients (also with the GQA group split) to the all-heads order."""
    from rlhf_kernels.ops import varlen_attention_triton as vt

    q, k, v, dout, cu_q, cu_k, max_q, max_k = _problem([19, 0, 40, 7], None, 8, 2, 16)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    args = (cu_q, cu_k, max_q, max_k, 0.25, True, window, 0.0)
    calls = []
    real = vt._head_section
    monkeypatch.setattr(vt, "_head_section", lambda *a: calls.append(a[1:]) or real(*a))
    monkeypatch.setattr(vt, "_l2_bytes", lambda device: 2 * 66 * 16 * 4)  # auto: 1 kv head
    got = {}
    for env in ("all", "1", "auto"):
        monkeypatch.setenv("RLHF_KERNELS_HEAD_SECTION", env)
        out, lse = vt.varlen_attention_triton_forward(q, k, v, *args)
        grads = [vt.varlen_attention_triton_backward(dout, q, k, v, out, lse, *args, gqa_split=s)
                 for s in (1, 2)]  # fmt: skip
        got[env] = [out, lse, *grads[0], *grads[1]]
    for env in ("1", "auto"):
        for a, b in zip(got["all"], got[env]):
            assert torch.equal(a, b)
    # (grid heads, heads per kv head, bytes each kv head's programs stream): forward and dQ
    # K + V of one kv head; dK/dV q, dO, lse and delta of the group's four query heads
    kv_bytes, q_bytes = 2 * 66 * 16 * 4, 66 * (2 * 16 * 4 + 8) * 4
    assert calls[:3] == [(8, 4, kv_bytes), (2, 1, q_bytes), (8, 4, kv_bytes)]
    assert calls[3] == (4, 2, q_bytes)  # gqa_split=2: two programs per kv head


def test_dq_reuses_the_forward_query_schedule(monkeypatch):
    """One schedule build less per fwd+bwd: the dQ launch takes the forward's query table (same
    block height), the dK/dV launch builds its key table; gradients as before."""
    from rlhf_kernels.ops import varlen_attention_triton as vt

    q, k, v, dout, cu_q, cu_k, max_q, max_k = _problem([19, 3, 40], None, 4, 2, 16)
    want = _run(_reference, q, k, v, dout, torch.float64, cu_q=cu_q, cu_k=cu_k, max_q=max_q,
                max_k=max_k, scale=0.25, causal=True, window=(-1, -1), softcap=0.0)  # fmt: skip
    built = []
    real = vt._schedule
    monkeypatch.setattr(vt, "_schedule", lambda *a: built.append(a[4]) or real(*a))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out, _ = triton_varlen_attention(*leaves, cu_q, cu_k, max_q, max_k, 0.25, True, (-1, -1), 0.0)
    out.backward(dout.float())
    assert built == [False, True]  # by_keys: the forward's query table, then dK/dV's key table
    for got, ref in zip((out, *(t.grad for t in leaves)), (want[0], *want[2:])):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_head_section_rule(monkeypatch):
    from rlhf_kernels.ops import varlen_attention_triton as vt

    mib = 1 << 20
    # 128k tokens, head_dim 64 bf16: 32 MiB of K/V per kv head, over half a 50 MiB L2
    assert vt._section("auto", 32, 1, 32 * mib, 50 * mib) == 1
    assert vt._section("auto", 32, 4, 2 * mib, 50 * mib) == 32  # 8 kv heads of 2 MiB fit
    assert vt._section("auto", 32, 1, 2 * mib, 50 * mib) == 8  # 12 fit: largest divisor 8
    assert vt._section("auto", 12, 2, 1, 0) == 12  # no L2 size (off CUDA): one section
    assert vt._section("all", 32, 1, 32 * mib, 50 * mib) == 32
    assert vt._section("3", 16, 2, 0, 0) == 4  # 3 kv heads asked: 2 (divides 8), 2 heads each
    assert vt._head_section(torch.device("cpu"), 16, 2, 32 * mib) == 16
    monkeypatch.setenv("RLHF_KERNELS_HEAD_SECTION", "two")
    with pytest.raises(ValueError, match="RLHF_KERNELS_HEAD_SECTION must be 'auto', 'all' or"):
        vt._head_section(torch.device("cpu"), 16, 2, 0)


def test_gqa_split_rule(monkeypatch):
    from types import SimpleNamespace

    from rlhf_kernels.ops import varlen_attention_triton as vt

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132)
    )
    cuda = torch.device("cuda", 0)
    assert vt._gqa_split(200, 8, 4, cuda) == 1  # 1600 programs fill 132 SMs
    assert vt._gqa_split(16, 2, 8, cuda) == 8  # 32 -> 256 programs (every head its own)
    assert vt._gqa_split(16, 2, 6, cuda) == 2  # only powers of two that divide the group
    assert vt._gqa_split(40, 1, 8, cuda) == 8
    assert vt._gqa_split(100, 1, 8, cuda) == 4  # 400 >= 264 after two doublings
    assert vt._gqa_split(1, 1, 8, torch.device("cpu")) == 1


def test_autotune_picks_fastest_fitting_candidate_once(monkeypatch):
    """``RLHF_KERNELS_AUTOTUNE=1`` on CUDA: the first launch times every candidate (skipping
    those that overflow shared memory), keeps the fastest, and later launches reuse it."""
    from types import SimpleNamespace

    from triton.runtime.errors import OutOfResources

    from rlhf_kernels.ops import varlen_attention_triton as vt

    launches = []

    class FakeKernel:
        fn = SimpleNamespace(__name__="fake_kernel")

        def __getitem__(self, grid):
            def run(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **meta):
                if BLOCK_N == 128:
                    raise OutOfResources(300000, 232448, "shared memory")
                launches.append((grid, BLOCK_M, BLOCK_N, num_warps, num_stages))

            return run

    fake_ms = {(64, 64, 4, 2): 3.0, (128, 64, 8, 2): 1.0, (64, 64, 4, 3): 2.0}

    def fake_time(fn, reps=5):
        fn()
        bm, bn, warps, stages = launches[-1][1:]
        return fake_ms[(bm, bn, warps, stages)]

    monkeypatch.setattr(vt, "_time_ms", fake_time)
    monkeypatch.setattr(vt, "_FITTING_BLOCKS", {})
    monkeypatch.setenv("RLHF_KERNELS_AUTOTUNE", "1")
    cuda = torch.device("cuda", 0)
    blocks = (64, 64, 4, 3)
    cands = vt._candidates(blocks, backward=True)
    assert cands[0] == blocks and len(cands) == len(set(cands)) == 5
    meta = dict(BLOCK_D=64, GROUP=1)

    def make(bm, bn):
        return (bm, 1), ()

    vt._launch(FakeKernel(), make, meta, blocks, cuda, backward=True)
    assert {lc[1:] for lc in launches} == set(fake_ms)  # every fitting candidate was timed
    assert launches[-1] == ((128, 1), 128, 64, 8, 2)  # then the real launch with the fastest
    launches.clear()
    vt._launch(FakeKernel(), make, meta, blocks, cuda, backward=True)
    assert launches == [((128, 1), 128, 64, 8, 2)]  # remembered: no second tuning
    launches.clear()  # another dtype with the same constexprs (fp32 under TF32) tunes anew
    vt._launch(FakeKernel(), make, meta, blocks, cuda, True, 0, torch.float32)
    assert len(launches) == len(fake_ms) + 1
    monkeypatch.setenv("RLHF_KERNELS_AUTOTUNE", "0")
    assert not vt._autotune_on(cuda) and not vt._autotune_on(torch.device("cpu"))
    # small defaults (fp32, head_dim > 128) also try halved tiles
    small = vt._candidates((32, 32, 4, 2), backward=True)
    assert (64, 32, 8, 2) in small and all(max(c[:2]) <= 64 for c in small)


@pytest.mark.gpu
def test_cuda_element_offsets_past_2_31():
    """A pack whose element offsets pass 2**31 (16 heads x 128 dims x 1.05M tokens): the last
    documents, addressed only through the 64-bit bases, match the reference in out and grads."""
    heads, dim = 16, 128
    lens = [4096] * 257 + [700, 1300]  # 2**31 / (16 * 128) = 1,048,576 tokens before the tail
    total = sum(lens)
    assert (total - 2000) * heads * dim > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    cu = _cu(lens).cuda()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, cu, causal=True, backend="triton")
    out.backward(do)
    tail = slice(total - 2000, total)
    small = [t[tail].detach() for t in (q, k, v, do)]
    cu_t = _cu([700, 1300]).cuda()
    kw = dict(cu_q=cu_t, cu_k=cu_t, max_q=1300, max_k=1300, scale=dim**-0.5, causal=True,
              window=(-1, -1), softcap=0.0)  # fmt: skip
    ref = _run(_reference, *[t.double() for t in small], torch.float64, **kw)
    low = _run(_reference, *[t.double() for t in small], torch.bfloat16, **kw)
    got = [out[tail].detach(), None] + [t.grad[tail] for t in leaves]
    for i, name in enumerate(NAMES):
        if name == "lse":
            continue
        err, torch_err = _max_err(got[i], ref[i], name), _max_err(low[i], ref[i], name)
        assert err <= 2 * torch_err + 1e-4 * ref[i].abs().max().item(), (name, err, torch_err)


@pytest.mark.gpu
def test_cuda_autotune_keeps_a_candidate_and_stays_exact(monkeypatch):
    from rlhf_kernels.ops import varlen_attention_triton as vt

    monkeypatch.setenv("RLHF_KERNELS_AUTOTUNE", "1")
    monkeypatch.setattr(vt, "_FITTING_BLOCKS", {})
    case = ("causal", [1000, 1, 0, 2047, 513], None, 8, 2, 128, True, (-1, -1), 0.0)
    _check(case, torch.bfloat16, device="cuda")
    tuned = {k[0]: v for k, v in vt._FITTING_BLOCKS.items() if k[-1]}
    assert set(tuned) == {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
    for name, blocks in tuned.items():
        kind = {"_fwd_kernel": "fwd", "_bwd_dkdv_kernel": "dkdv", "_bwd_dq_kernel": "dq"}[name]
        default = vt._block_sizes(128, torch.bfloat16, kind, 3561)
        assert blocks in vt._candidates(default, backward=name != "_fwd_kernel")
