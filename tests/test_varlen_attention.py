"""varlen_attention: the torch backend and input validation, against a float64 reference."""

import pytest
import torch

from rlhf_kernels import varlen_attention
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference

LENS = [1, 5, 47, 0, 31, 2]  # uneven, includes length 1 and an empty sequence
CASES = [  # (causal, window_size, softcap)
    (True, (-1, -1), 0.0),
    (False, (-1, -1), 0.0),
    (True, (7, -1), 0.0),
    (False, (5, 3), 0.0),
    (True, (-1, -1), 4.0),
]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _qkv(lens_q, lens_k, heads=4, kv_heads=2, dim=40, dtype=torch.float64):
    q = torch.randn(sum(lens_q), heads, dim, dtype=dtype)
    k = torch.randn(sum(lens_k), kv_heads, dim, dtype=dtype)
    v = torch.randn(sum(lens_k), kv_heads, dim, dtype=dtype)
    return q, k, v


def _dense_reference(q, k, v, lens_q, lens_k, causal, window, softcap):
    """Independent check of the reference: the whole pack as one masked matrix."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    left, right = window
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):  # its own loops, not the library's attention_mask
        for i in range(lq):
            at = i + lk - lq  # bottom-right alignment: query i sits at key position i + lk - lq
            for j in range(lk):
                seen = (not causal or j <= at) and (left < 0 or j >= at - left)
                mask[oq + i, ok + j] = seen and (right < 0 or j <= at + right)
        oq, ok = oq + lq, ok + lk
    s = torch.einsum("qhd,khd->hqk", q, kk) / q.shape[-1] ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1))
    assert heads == s.shape[0]
    return torch.einsum("hqk,khd->qhd", p, vv), lse


@pytest.mark.parametrize("causal,window,softcap", CASES)
def test_reference_matches_dense_whole_pack(causal, window, softcap):
    lens_k = [3, 5, 47, 0, 31, 6]  # lq <= lk and lq > lk: bottom-right alignment, empty rows
    q, k, v = _qkv(LENS, lens_k)
    out, lse = varlen_attention_reference(
        q, k, v, _cu(LENS), _cu(lens_k), causal=causal, window_size=window, softcap=softcap
    )
    out_d, lse_d = _dense_reference(q, k, v, LENS, lens_k, causal, window, softcap)
    torch.testing.assert_close(out, out_d, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_d, rtol=1e-10, atol=1e-10)


def test_bottom_right_alignment_gives_empty_rows():
    # lq=4, lk=2 causal: the first two queries see no key -> out 0, lse -inf.
    q, k, v = _qkv([4], [2])
    out, lse = varlen_attention_reference(q, k, v, _cu([4]), _cu([2]), causal=True)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:, :2]))
    assert torch.all(torch.isfinite(lse[:, 2:]))


@pytest.mark.parametrize("causal,window,softcap", CASES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_torch_backend_fp32_forward_backward(causal, window, softcap, return_lse):
    q64, k64, v64 = _qkv(LENS, LENS)
    for t in (q64, k64, v64):
        t.requires_grad_(True)
    ref, ref_lse = varlen_attention_reference(
        q64, k64, v64, _cu(LENS), _cu(LENS), causal=causal, window_size=window, softcap=softcap
    )
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do)

    q, k, v = (t.detach().float().requires_grad_(True) for t in (q64, k64, v64))
    res = varlen_attention(
        q,
        k,
        v,
        _cu(LENS),
        _cu(LENS),
        max(LENS),
        max(LENS),
        causal=causal,
        window_size=window,
        softcap=softcap,
        return_lse=return_lse,
        backend="torch",
    )
    out = res[0] if return_lse else res
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    if return_lse:
        assert res[1].dtype == torch.float32 and res[1].shape == (4, sum(LENS))
        torch.testing.assert_close(res[1].double(), ref_lse, rtol=0, atol=2e-6)
    grads = torch.autograd.grad(out, (q, k, v), do.float())
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window,softcap", [CASES[0], CASES[2], CASES[4]])
def test_torch_backend_low_precision_within_twice_plain_torch(dtype, causal, window, softcap):
    lens = [67, 1, 123, 31]
    q64, k64, v64 = _qkv(lens, lens, heads=4, kv_heads=1, dim=40)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    ref, _ = varlen_attention_reference(q64, k64, v64, _cu(lens), _cu(lens), **kw)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    plain, _ = varlen_attention_reference(q, k, v, _cu(lens), _cu(lens), **kw)  # no upcast
    ours = varlen_attention(q, k, v, _cu(lens), _cu(lens), backend="torch", **kw)
    assert ours.dtype == dtype
    err_plain = (plain.double() - ref).abs().max().item()
    err_ours = (ours.double() - ref).abs().max().item()
    assert err_ours <= 2 * err_plain + 1e-6, (err_ours, err_plain)


def test_gqa_matches_expanded_heads():
    q, k, v = _qkv(LENS, LENS, heads=6, kv_heads=2)
    out = varlen_attention(q, k, v, _cu(LENS), _cu(LENS), causal=True, backend="torch")
    full = varlen_attention(
        q,
        k.repeat_interleave(3, 1),
        v.repeat_interleave(3, 1),
        _cu(LENS),
        _cu(LENS),
        causal=True,
        backend="torch",
    )
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)


def test_samples_do_not_interact():
    q, k, v = _qkv(LENS, LENS)
    out = varlen_attention(q, k, v, _cu(LENS), _cu(LENS), causal=True, backend="torch")
    k2, v2 = k.clone(), v.clone()
    k2[:6] += 10.0  # perturb the first two sequences only
    v2[:6] -= 3.0
    out2 = varlen_attention(q, k2, v2, _cu(LENS), _cu(LENS), causal=True, backend="torch")
    assert not torch.allclose(out[:6], out2[:6])
    torch.testing.assert_close(out[6:], out2[6:], rtol=0, atol=0)


def test_auto_on_cpu_is_torch_and_dropout_only_in_training_math():
    torch.manual_seed(0)  # fixed inputs: the statistical check below is deterministic
    q, k, v = _qkv([9, 4], [9, 4], dtype=torch.float32)
    a = varlen_attention(q, k, v, _cu([9, 4]), _cu([9, 4]), causal=True)
    b = varlen_attention(q, k, v, _cu([9, 4]), _cu([9, 4]), causal=True, backend="torch")
    torch.testing.assert_close(a, b, rtol=0, atol=0)

    def dropped(v, seed):
        torch.manual_seed(seed)
        return varlen_attention(
            q, k, v, _cu([9, 4]), _cu([9, 4]), causal=True, dropout_p=0.5, backend="torch"
        )

    d = dropped(v, 0)
    assert d.shape == q.shape and not torch.allclose(d, b)  # (b: the same causal call)
    # unbiased: the mean over draws is the output without dropout
    draws = torch.stack([dropped(v, s) for s in range(400)])
    standard_error = draws.std(0) / 400**0.5
    assert ((draws.mean(0) - b).abs() <= 5 * standard_error + 1e-4).all()
    # still causal: the first sample's last value reaches no earlier row
    v2 = v.clone()
    v2[8] += 100.0
    assert torch.equal(dropped(v, 1)[:8], dropped(v2, 1)[:8])


# ----------------------------------------------------------------------------- bad input
def _args(**over):
    q, k, v = _qkv([3, 4], [3, 4], dtype=torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 4]), cu_seqlens_k=_cu([3, 4]))
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(q=torch.randn(7, 4)), ValueError, "q must be"),
        (dict(k=torch.randn(7, 2, 32), v=torch.randn(7, 2, 32)), ValueError, "head_dim"),
        (
            dict(k=torch.randn(7, 3, 40), v=torch.randn(7, 3, 40)),
            ValueError,
            "multiple of kv heads",
        ),
        (dict(v=torch.randn(7, 2, 32)), ValueError, "k and v must have the same shape"),
        (
            dict(k=torch.randn(7, 0, 40), v=torch.randn(7, 0, 40)),
            ValueError,
            r"heads of q \(4\) must be a multiple of kv heads of k \(0\)",
        ),
        (dict(v=torch.randn(7, 2, 40, dtype=torch.float16)), TypeError, "share a dtype"),
        (dict(q=torch.randint(0, 3, (7, 4, 40))), TypeError, "q must be float"),
        (
            dict(cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32)),
            ValueError,
            "non-decreasing",
        ),
        (
            dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)),
            ValueError,
            r"\[0\] must be 0",
        ),
        (
            dict(cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32)),
            ValueError,
            "must equal the packed length 7",
        ),
        (dict(cu_seqlens_q=torch.tensor([0, 3.0, 7])), TypeError, "int32 or int64"),
        (dict(cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "same number"),
        (
            dict(q=torch.randn(7, 4, 300), k=torch.randn(7, 2, 300), v=torch.randn(7, 2, 300)),
            ValueError,
            r"\[1, 256\]",
        ),
        (dict(q=torch.randn(7, 4, 40, device="meta")), ValueError, "same device"),
    ],
)
def test_bad_input_raises_before_work(over, exc, match):
    with pytest.raises(exc, match=match):
        varlen_attention(**_args(**over))


def test_bad_options_raise():
    with pytest.raises(ValueError, match="max_seqlen_q=2 is smaller"):
        varlen_attention(**_args(), max_seqlen_q=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        varlen_attention(**_args(), backend="cuda")
    with pytest.raises(ValueError, match="does not support dropout"):
        varlen_attention(**_args(), dropout_p=0.1, backend="triton")
    with pytest.raises(ValueError, match="needs CUDA"):
        varlen_attention(**_args(), backend="flash_attn")
    with pytest.raises(ValueError, match="softcap"):
        varlen_attention(**_args(), softcap=-1.0)
    with pytest.raises(ValueError, match="dropout_p"):
        varlen_attention(**_args(), dropout_p=1.5)


def test_cu_seqlens_validation_is_cached_but_sees_in_place_edits(monkeypatch):
    """Device tensors (faked here) are read once per version; CPU tensors are read every time,
    so a write that does not bump the version (NumPy alias, ``dist.broadcast``) is seen."""
    from rlhf_kernels import _checks
    from rlhf_kernels._checks import check_cu_seqlens

    cu = _cu([3, 4])
    cu.numpy()[1] = 5  # no version bump
    assert check_cu_seqlens(cu, 7) == [0, 5, 7]
    cu.numpy()[1] = 2
    assert check_cu_seqlens(cu, 7) == [0, 2, 7]  # CPU: read again
    q = torch.randn(7, 2, 8)
    cu.numpy()[1] = 6
    out = varlen_attention(q, q, q, cu, cu, backend="torch")
    ref = varlen_attention(q, q, q, _cu([6, 1]), _cu([6, 1]), backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

    monkeypatch.setattr(_checks, "_read_every_time", lambda t: False)  # as on CUDA
    cu = _cu([3, 4])
    assert check_cu_seqlens(cu, 7) == [0, 3, 7]
    monkeypatch.setattr(cu, "tolist", lambda: pytest.fail("a cache hit reads the tensor"))
    assert check_cu_seqlens(cu, 7) == [0, 3, 7]  # cached
    with pytest.raises(ValueError, match="packed length 8"):
        check_cu_seqlens(cu, 8)
    monkeypatch.undo()
    monkeypatch.setattr(_checks, "_read_every_time", lambda t: False)
    cu[1] = 9  # bumps the version counter: must be re-read and rejected
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(cu, 7)
    cu[1] = 3
    assert check_cu_seqlens(cu, 7) == [0, 3, 7]
    version = cu._version
    cu.data = _cu([1, 6])  # new storage, version kept: re-read (the data pointer changed)
    assert cu._version == version
    assert check_cu_seqlens(cu, 7) == [0, 1, 7]


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1))])
def test_torch_backend_fused_path_with_unequal_lengths(causal, window):
    """No lse/softcap takes the SDPA path where it is valid; lq != lk must stay bottom-right."""
    lens_q, lens_k = [3, 9, 1, 6], [7, 9, 4, 2]
    q, k, v = _qkv(lens_q, lens_k, dtype=torch.float32)
    ref, _ = varlen_attention_reference(
        q.double(),
        k.double(),
        v.double(),
        _cu(lens_q),
        _cu(lens_k),
        causal=causal,
        window_size=window,
    )
    out = varlen_attention(
        q, k, v, _cu(lens_q), _cu(lens_k), causal=causal, window_size=window, backend="torch"
    )
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


def test_sliding_window_self_attention_uses_fused_path_and_matches():
    q, k, v = _qkv(LENS, LENS, dtype=torch.float32)
    for window in [(4, 0), (3, 2), (-1, 5)]:
        ref, _ = varlen_attention_reference(
            q.double(), k.double(), v.double(), _cu(LENS), _cu(LENS), window_size=window
        )
        out = varlen_attention(q, k, v, _cu(LENS), _cu(LENS), window_size=window, backend="torch")
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


def test_oversized_max_seqlen_is_accepted():
    a = _args()
    out = varlen_attention(**a, max_seqlen_q=4096, max_seqlen_k=4096, causal=True)
    torch.testing.assert_close(out, varlen_attention(**a, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(window_size=None), TypeError, "pair of ints"),
        (dict(window_size=(2.5, 0)), TypeError, "pair of ints"),
        (dict(softcap=float("nan")), ValueError, "softcap must be a number in"),
        (dict(softcap=float("inf")), ValueError, "softcap must be a number in"),
        (dict(softcap=1e300), ValueError, "softcap must be a number in"),  # fp32 scores: NaN
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite"),
        (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be a finite"),
        (dict(softmax_scale="0.1"), ValueError, "softmax_scale must be a finite"),
        (dict(causal=None), TypeError, "causal must be a bool, got NoneType"),
        (dict(causal="no"), TypeError, "causal must be a bool, got str"),  # ran causal
        (dict(max_seqlen_q="8"), TypeError, "max_seqlen_q must be an int or None, got str"),
        (dict(dropout_p=None), ValueError, r"dropout_p must be a number in \[0, 1\), got None"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be a number in \[0, 1\), got 1.0"),
        (dict(causal=1), TypeError, "causal must be a bool, got int"),
        (
            dict(max_seqlen_q=3),
            ValueError,
            r"max_seqlen_q=3 is smaller than the longest sequence \(4\)",
        ),
    ],
)
def test_bad_option_types(over, exc, match):
    with pytest.raises(exc, match=match):
        varlen_attention(**_args(), **over)


def test_numpy_bool_causal_is_a_bool():
    """``causal=np.bool_(True)`` (a flag read from a NumPy config) was refused as 'not a bool'."""
    np = pytest.importorskip("numpy")
    a = _args()
    for flag in (True, False):
        torch.testing.assert_close(
            varlen_attention(**a, causal=np.bool_(flag)), varlen_attention(**a, causal=flag)
        )


def test_softcap_none_is_off_and_float64_takes_large_caps():
    a = _args()
    off = varlen_attention(**a, causal=True)
    torch.testing.assert_close(varlen_attention(**a, causal=True, softcap=None), off)
    a64 = {n: t.double() if t.is_floating_point() else t for n, t in a.items()}
    capped = varlen_attention(**a64, causal=True, softcap=1e300)  # fp64 scores hold it
    torch.testing.assert_close(capped.float(), off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_nan_inputs_give_nan_like_plain_attention(dtype, grad):
    """CPU SDPA's fused kernel wrote 0 for a query row with a NaN score (a diverged model looked
    fine in no-grad forwards); such inputs now take the explicit path, as plain torch would."""
    lens = [3, 5, 4]
    q, k, v = (t.to(dtype) for t in _qkv(lens, lens, dim=16))
    q[0, 0, 0] = float("nan")  # query 0 of sequence 0, head 0
    k[3, 1, 0] = float("nan")  # key 0 of sequence 1, kv head 1 (query heads 2, 3)
    q.requires_grad_(grad)
    for causal in (False, True):
        out = varlen_attention(q, k, v, _cu(lens), _cu(lens), causal=causal, backend="torch")
        assert out[0, 0].isnan().all() and out[3:8, 2:].isnan().all()
        assert torch.isfinite(out[1:3]).all() and torch.isfinite(out[3:8, :2]).all()
        assert torch.isfinite(out[8:]).all()  # the clean sequence is untouched


def test_degenerate_shapes_raise():
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 0"):
        varlen_attention(
            **_args(q=torch.randn(7, 4, 0), k=torch.randn(7, 2, 0), v=torch.randn(7, 2, 0))
        )
    with pytest.raises(ValueError, match="at least one head"):
        varlen_attention(**_args(q=torch.randn(7, 0, 40)))


def test_triton_reads_strided_cu_seqlens_correctly():
    """A strided cu_seqlens view once made the kernels read (and write) out of bounds."""
    cu = torch.tensor([0, 99, 4, 99, 10, 99], dtype=torch.int32)[::2]  # [0, 4, 10], stride 2
    q, k, v = _qkv([4, 6], [4, 6], dtype=torch.float32)
    out = varlen_attention(q, k, v, cu, cu, causal=True, backend="triton")
    ref = varlen_attention(q, k, v, cu.contiguous(), cu.contiguous(), causal=True, backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, -1))])
@pytest.mark.parametrize("batch_scores", [1 << 22, 60])  # 60: forces split batches
def test_equal_length_sequences_batched_in_sdpa(monkeypatch, causal, window, batch_scores):
    from rlhf_kernels.ops import varlen_attention as va

    monkeypatch.setattr(va, "_SDPA_BATCH_SCORES", batch_scores)
    lens = [5, 9, 5, 5, 9, 0, 3, 5]  # repeated lengths, interleaved
    q64, k64, v64 = (t.requires_grad_(True) for t in _qkv(lens, lens, heads=4, kv_heads=2))
    ref, _ = varlen_attention_reference(
        q64, k64, v64, _cu(lens), _cu(lens), causal=causal, window_size=window
    )
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do)
    q, k, v = (t.detach().float().requires_grad_(True) for t in (q64, k64, v64))
    out = varlen_attention(
        q, k, v, _cu(lens), _cu(lens), causal=causal, window_size=window, backend="torch"
    )
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    for g, rg in zip(torch.autograd.grad(out, (q, k, v), do.float()), ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- window_size forms
@pytest.mark.parametrize(
    "window",
    [
        [3, 0],
        torch.tensor([3, 0]),
        torch.tensor([3, 0], dtype=torch.int32),
        (torch.tensor(3), 0),
        pytest.param("numpy", id="numpy"),
    ],
)
def test_window_size_any_integer_pair(window):
    if isinstance(window, str):
        np = pytest.importorskip("numpy")
        window = np.array([3, 0])
    a = _args()
    ref = varlen_attention(**a, causal=True, window_size=(3, 0))
    out = varlen_attention(**a, causal=True, window_size=window)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_side_reaching_max_seqlen_k_is_unbounded(backend):
    """flash-attn makes a side >= max_seqlen_k unbounded: with 8 queries on 2 keys,
    window (-1, 2) is full attention there (ours hid every key from 4 rows), while a larger
    max_seqlen_k keeps the bound; a side beyond int64 overflowed the torch backend."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, 4, generator=g) for n in (8, 2, 2))
    cu_q, cu_k = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    kw = dict(causal=False, backend=backend)
    full = varlen_attention(q, k, v, cu_q, cu_k, **kw)
    torch.testing.assert_close(
        varlen_attention(q, k, v, cu_q, cu_k, window_size=(-1, 2), **kw), full
    )
    bounded = varlen_attention(q, k, v, cu_q, cu_k, 8, 5, window_size=(-1, 2), **kw)
    assert (bounded[:4] == 0).all() and (bounded[4:] != 0).all()  # 2 < max_seqlen_k 5: kept
    qq, cu = torch.randn(4, 1, 4, generator=g), torch.tensor([0, 4], dtype=torch.int32)
    huge = varlen_attention(qq, qq, qq, cu, cu, window_size=(2**70, 2**70), **kw)
    torch.testing.assert_close(huge, varlen_attention(qq, qq, qq, cu, cu, **kw))


@pytest.mark.parametrize(
    "window,exc,match",
    [
        ((3,), ValueError, r"window_size must be a pair of ints \(left, right\), got 1 entries"),
        ([1, 2, 3], ValueError, "got 3 entries"),
        (torch.tensor([[3, 0]]), ValueError, "got 1 entries"),
        (torch.tensor([3.0, 0.0]), TypeError, "window_size .* got a float entry"),
        (torch.tensor(3), TypeError, "window_size .* got Tensor"),
        ((True, 0), TypeError, "window_size .* bool"),
        ("ab", TypeError, "window_size .* got str"),
        ({0: 1, 1: 2}, TypeError, "window_size .* got dict"),
    ],
)
def test_window_size_bad_forms_raise(window, exc, match):
    with pytest.raises(exc, match=match):
        varlen_attention(**_args(), window_size=window)


# ----------------------------------------------------------------------------- gradient precision
def _out_and_grads(fn, inputs64, do, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in inputs64)
    out = fn(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), do.to(dtype))]


def _errors_vs_plain(dtype, lens, heads, kv_heads, dim, **kw):
    """Max |error| vs float64 of out/dq/dk/dv: ours (torch backend) and plain torch in ``dtype``."""
    inputs64 = [t.requires_grad_(True) for t in _qkv(lens, lens, heads, kv_heads, dim)]
    cu = _cu(lens)
    ref, _ = varlen_attention_reference(*inputs64, cu, cu, **kw)
    do = torch.randn_like(ref)
    exact = [ref, *torch.autograd.grad(ref, inputs64, do)]

    def plain(q, k, v):  # K/V expanded by repeat_interleave, math in dtype
        return varlen_attention_reference(q, k, v, cu, cu, **kw)[0]

    def ours(q, k, v):
        return varlen_attention(q, k, v, cu, cu, backend="torch", **kw)

    errors = {}
    for name, fn in (("plain", plain), ("ours", ours)):
        got = _out_and_grads(fn, inputs64, do, dtype)
        errors[name] = [(g.double() - e).abs().max().item() for g, e in zip(got, exact)]
    return errors


def _assert_within_twice_plain(errors):
    for what, e_ours, e_plain in zip(("out", "dq", "dk", "dv"), errors["ours"], errors["plain"]):
        assert e_ours <= 2 * e_plain, f"{what}: {e_ours:.3g} > 2 x plain {e_plain:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gqa_gradients_within_twice_plain_torch(dtype):
    """SDPA's enable_gqa backward summed the 32 heads' dK/dV in low precision: 2.3-3x plain."""
    errors = _errors_vs_plain(dtype, [256, 5, 40], heads=32, kv_heads=1, dim=32, causal=True)
    _assert_within_twice_plain(errors)


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (7, -1))])
def test_fp32_gradients_within_twice_plain_torch(kv_heads, causal, window):
    """CPU's fused fp32 SDPA backward reached 2-4x plain fp32 error (dq worst)."""
    errors = _errors_vs_plain(
        torch.float32, [67, 1, 123, 31], 4, kv_heads, 40, causal=causal, window_size=window
    )
    _assert_within_twice_plain(errors)


def test_fp32_without_gradients_keeps_fused_forward():
    """Inference needs no backward: fp32 forward error of SDPA is plain torch's."""
    lens = [67, 1, 123, 31]
    q, k, v = _qkv(lens, lens, dim=40)
    ref, _ = varlen_attention_reference(q, k, v, _cu(lens), _cu(lens), causal=True)
    plain, _ = varlen_attention_reference(
        q.float(), k.float(), v.float(), _cu(lens), _cu(lens), causal=True
    )
    with torch.no_grad():
        out = varlen_attention(
            q.float(), k.float(), v.float(), _cu(lens), _cu(lens), causal=True, backend="torch"
        )
    err, err_plain = ((t.double() - ref).abs().max().item() for t in (out, plain))
    assert err <= 2 * err_plain, (err, err_plain)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_pack_stays_connected_to_its_inputs(backend):
    """A pack without sequences: the torch backend returned new zeros, so backward raised and
    the projections got None gradients (DDP's unused-parameter error)."""
    q, k, v = (torch.zeros(0, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = varlen_attention(
        q, k, v, cu, cu, 0, 0, causal=True, backend=backend, return_lse=True
    )
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_float64_lse_keeps_float64_precision():
    """The torch backend cut a float64 input's lse to fp32 (1e-7 off the float64 reference,
    and gradcheck through the lse failed); eager and compiled agree on its dtype."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(5, 2, 3, dtype=torch.float64, generator=g) for _ in range(2))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    _, lse = varlen_attention(q, k, v, cu, cu, return_lse=True, backend="torch")
    _, ref = varlen_attention_reference(q, k, v, cu, cu)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref, atol=1e-12, rtol=0)

    def lse_of(q):
        return varlen_attention(q, k, v, cu, cu, return_lse=True, backend="torch")[1]

    assert torch.autograd.gradcheck(lse_of, (q,))
    torch._dynamo.reset()
    compiled = torch.compile(lse_of, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q), lse, atol=1e-14, rtol=0)
