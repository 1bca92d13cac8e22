"""One-command GPU benchmark: the second half of ``make gpu-check`` (the first: ``pytest -m gpu``).

Measures on one CUDA device, bf16, with CUDA-event timing (``triton.testing.do_bench``, median):

- ``attention``: packed causal attention, forward and forward+backward, at 8k/32k/128k-token packs
  of uneven documents (lengths drawn in ``[total/16, total/4]``), head_dim 64 (32 heads) and 128
  (16 heads), and one more 32k pack per head_dim that is skewed (half the tokens in one
  document, the rest in 32-512-token documents), where a rectangular
  ``(batch, max_len / block)`` grid would be mostly empty programs (ours schedules a flat table
  of blocks, heaviest first). Peers on the same pack: ``varlen_attention(backend="triton")``
  (ours, with the default blocks, with ``RLHF_KERNELS_AUTOTUNE=1``, and, on packs where the
  default grid runs in head sections, with ``RLHF_KERNELS_HEAD_SECTION=all``: the order
  before sections),
  ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention kernels shipped inside torch; the
  flash-attn package itself when importable), one SDPA flash call per document, and compiled
  ``flex_attention`` with a document-causal block mask. Every peer is compared with ours first
  (max error relative to ours' largest entry; over 2% is flagged ``mismatch``). TFLOP/s count
  useful causal FLOPs: ``4 * sum(l^2) / 2 * H * D`` forward, 2.5x that for the backward.
- ``linear_logprobs``: T=32k, H=4096, V=128k: ours (per-token log-probs, fwd+bwd of
  ``sum(w * logp)``), ours as a loss (``linear_nll_loss``, gradients made in the forward), the
  naive fp32 ``log_softmax`` + gather, ``F.cross_entropy`` and Liger's fused linear
  cross-entropy when liger-kernel is importable. Time and peak memory above the inputs.
- ``gae``: B=64, T=1024 fp32, our ``gae`` on CPU (one thread) and CUDA vs a Python loop.
- ``ring_tile``: ring attention's block work on the Triton path (``forward_block_triton`` /
  ``backward_block_triton``: one launch per block, fp32 merge by lse) for every rank of a
  zigzag plan over 2 and 4 ranks of a 32k pack, without communication; the slowest rank
  against single-device attention on the whole pack divided by the world size (``*_vs_ideal``,
  1.0 = no overhead from splitting).

Writes ``bench/results/gpu-check-<gpu>[-quick]-<date>-<HHMMSS>.json`` and ``.md`` (hardware,
versions, whether the native extension and its CUDA GAE were built, start time, seconds per
part), rewritten after every row; ``--budget-s`` (capped by ``$GPU_CHECK_DEADLINE``) starts no
new row past it. Ring-tile rows are checked like the attention rows (relative error of out and
dq over 2%: ``mismatch``). Exit status 1 when a part raised, did not finish, one of
ours (or our GAE / linear ops) failed, or a peer's result mismatched; a peer's own failure (out
of memory) is only reported.
``--quick`` runs small shapes (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf_kernels.ops import varlen_attention_triton as vt  # noqa: E402
from rlhf_kernels.ops.varlen_attention import varlen_attention  # noqa: E402

MIN_CALLS = 5  # timed calls per median, also for calls slower than do_bench's rep / 5


def _bench(fn, quick=False):
    """Median ms of ``fn()`` over at least ``MIN_CALLS`` timed calls (CUDA events via triton's
    do_bench, whose ``rep`` budget alone timed one call of a 200 ms step)."""
    import torch
    from triton.testing import do_bench

    fn()  # (compilation, autotuning) then one call timed for the budget
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(20 if quick else 100, MIN_CALLS * 1.2 * start.elapsed_time(end))
    return float(do_bench(fn, warmup=5 if quick else 25, rep=rep, return_mode="median"))


def _lengths(total, lo, hi, seed=0):
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return out


def _causal_flops(lengths, heads, dim):
    return 2.0 * sum(n * n for n in lengths) * heads * dim  # 4 * l^2 / 2 per head and dim


# ----------------------------------------------------------------------------- attention
def _attention_peers(lengths, heads, dim):
    """name -> fn(q, k, v) -> out (T, H, D), for the peers available here."""
    cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device="cuda")
    maxlen = max(lengths)

    def ours(q, k, v):
        return varlen_attention(q, k, v, cu, cu, maxlen, maxlen, causal=True, backend="triton")

    # the autotuned entry runs (forward and backward) with RLHF_KERNELS_AUTOTUNE=1 set by
    # _attention_case: its blocks are timed on the first call of each kernel configuration
    peers = {"ours_triton": ours, "ours_triton_autotuned": ours, "ours_triton_all_heads": ours}
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        peers["torch_varlen_flash"] = lambda q, k, v: varlen_attn(
            q, k, v, cu, cu, maxlen, maxlen, **kw
        )
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        peers["flash_attn"] = lambda q, k, v: flash_attn_varlen_func(
            q, k, v, cu, cu, maxlen, maxlen, causal=True
        )
    except Exception as e:  # not installed, or a broken build: the other peers still run
        print(f"flash_attn peer skipped: {type(e).__name__}: {e}", flush=True)
    starts = [0] + list(_cumsum(lengths))

    def sdpa_flash_loop(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        outs = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for a, b in zip(starts[:-1], starts[1:]):
                qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0])
        return torch.cat([o.transpose(0, 1) for o in outs])

    peers["sdpa_flash_loop"] = sdpa_flash_loop
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(
            torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda")
        )
        total = sum(lengths)

        def doc_causal(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        # compiled mask construction: the eager one materialises the T x T mask (128 GiB at 128k)
        mask = torch.compile(create_block_mask)(doc_causal, 1, 1, total, total, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_doc(q, k, v):
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
            return flex(qs, ks, vs, block_mask=mask)[0].transpose(0, 1)

        peers["flex_doc_mask"] = flex_doc
    except Exception as err:  # ImportError, or the mask does not fit: report, go on
        print(f"flex_doc_mask skipped at T={sum(lengths)}: {err!r:.200}", flush=True)
    return peers


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def bench_attention(quick):
    totals = (2048, 4096) if quick else (8192, 32768, 131072)
    for dim in (64, 128):
        for total in totals:
            yield from _attention_case(total, dim, quick)
            torch.cuda.empty_cache()
        yield from _attention_case(totals[1], dim, quick, skewed=True)


# a peer whose bf16 output (or dq) is further than this from ours, relative to the largest
# entry of ours, is flagged ``mismatch`` (bf16 rounding alone is ~4e-3 of it)
MISMATCH_REL = 2e-2


def _attention_case(total, dim, quick, skewed=False):
    torch._dynamo.reset()  # flex recompiles per shape: keep under dynamo's recompile limit
    heads = 2048 // dim
    if skewed:  # one document of half the pack, the rest short
        lengths = [total // 2, *_lengths(total - total // 2, 32, 512, seed=total + dim)]
    else:
        lengths = _lengths(total, total // 16, total // 4, seed=total + dim)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    flops = _causal_flops(lengths, heads, dim)
    ref = ref_name = None
    # forward's heads per section by default (every head when the pack's K/V fit half the L2)
    section = vt._head_section(q.device, heads, 1, 4 * total * dim)
    for name, fn in _attention_peers(lengths, heads, dim).items():
        if name.endswith("_all_heads") and section == heads:
            continue  # the default order already
        _set_env("RLHF_KERNELS_AUTOTUNE", "1" if name.endswith("_autotuned") else None)
        _set_env("RLHF_KERNELS_HEAD_SECTION", "all" if name.endswith("_all_heads") else None)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        base = dict(total=total, dim=dim, heads=heads, docs=len(lengths), method=name,
                    mix="skewed" if skewed else "uneven")  # fmt: skip
        try:  # a peer that cannot run this shape (or runs out of memory) is reported
            out = fn(*leaves)
            out.backward(do)
            got = (out.detach().float(), leaves[0].grad.float())
            del out
            if ref is None:
                ref, ref_name = got, name
            err = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]

            def step(fn=fn, leaves=leaves):
                for x in leaves:
                    x.grad = None
                fn(*leaves).backward(do)

            fwd_ms = _bench(lambda fn=fn: fn(q, k, v), quick)
            fb_ms = _bench(step, quick)
        except Exception as e:
            _set_env("RLHF_KERNELS_AUTOTUNE", None)
            _set_env("RLHF_KERNELS_HEAD_SECTION", None)
            yield dict(base, error=repr(e)[:300])
            torch.cuda.empty_cache()
            continue
        row = dict(
            base, fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms,
            fwd_tflops=flops / fwd_ms / 1e9, fwd_bwd_tflops=3.5 * flops / fb_ms / 1e9,
            reference=ref_name, rel_err_out=err[0], rel_err_dq=err[1],
            mismatch=_mismatch(err),
        )  # fmt: skip
        if name.startswith("ours"):  # the forward grid's heads per section
            row["fwd_heads_per_section"] = heads if name.endswith("_all_heads") else section
        print(_fmt_attention(row), flush=True)
        yield row
    _set_env("RLHF_KERNELS_AUTOTUNE", None)
    _set_env("RLHF_KERNELS_HEAD_SECTION", None)


def _set_env(name, value):
    """Set ``name`` to ``value``, or unset it when ``value`` is None."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _fmt_attention(r):
    return (
        f"attention D={r['dim']:3d} T={r['total']:6d} {r['method']:>18}: fwd "
        f"{r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TFLOP/s | fwd+bwd {r['fwd_bwd_ms']:8.3f} ms "
        f"{r['fwd_bwd_tflops']:6.1f} TFLOP/s | rel err out {r['rel_err_out']:.3g}, dq "
        f"{r['rel_err_dq']:.3g} vs {r['reference']}{'  MISMATCH' if r['mismatch'] else ''}"
    )


# ----------------------------------------------------------------------------- linear logprobs
def bench_linear(quick):
    from rlhf_kernels.ops.linear_logprobs import linear_logprobs, linear_nll_loss

    T, H, V = (4096, 1024, 32768) if quick else (32768, 4096, 131072)
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    wt = torch.rand(T, device="cuda", generator=g)

    def naive_logprobs():
        logp = torch.log_softmax((h @ w.T).float(), -1).gather(1, labels[:, None])[:, 0]
        (logp * wt).sum().backward()

    with torch.no_grad():  # values first: a fast but wrong kernel must not pass
        want = torch.log_softmax((h @ w.T).float(), -1).gather(1, labels[:, None])[:, 0]
        rel = (linear_logprobs(h, w, labels).float() - want).abs().max() / want.abs().max()
        check = dict(rel_err_logp_vs_naive=rel.item(), mismatch=_mismatch([rel.item()]))
        del want
    methods = {
        "naive_logsoftmax_gather": naive_logprobs,
        "linear_logprobs": lambda: (linear_logprobs(h, w, labels) * wt).sum().backward(),
        "naive_cross_entropy": lambda: F.cross_entropy((h @ w.T).float(), labels).backward(),
        "linear_nll_loss": lambda: linear_nll_loss(h, w, labels).backward(),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        methods["liger_fused_linear_ce"] = lambda: liger(w, h, labels).backward()
    except Exception as e:  # not installed, or a broken install: the others still run
        print(f"liger peer skipped: {type(e).__name__}: {e}", flush=True)
    for name, fn in methods.items():
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def step(fn=fn):
            h.grad = w.grad = None
            fn()

        try:
            fn()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = _bench(step, quick)
        except Exception as err:
            yield dict(method=name, T=T, H=H, V=V, error=repr(err)[:300])
            torch.cuda.empty_cache()
            continue
        print(f"linear {name:>26}: {ms:9.2f} ms  peak +{peak:9.0f} MiB", flush=True)
        row = dict(method=name, T=T, H=H, V=V, ms=ms, peak_extra_mib=peak)
        yield row | (check if name == "linear_logprobs" else {})
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- gae
def bench_gae(quick):
    from rlhf_kernels.ops.gae import gae, gae_reference

    B, T = (8, 256) if quick else (64, 1024)
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # medians, after one warm-up call each
        loop_ms = _median_ms(lambda: gae_reference(r, v, mask, 0.99, 0.95), 3)
        rows = [dict(method="python_loop_cpu_1thread", B=B, T=T, ms=loop_ms)]
        ms = _median_ms(lambda: gae(r, v, gamma=0.99, lam=0.95, mask=mask), 20)
        rows.append(dict(method="gae_cpu_1thread", B=B, T=T, ms=ms, speedup=loop_ms / ms))
    finally:
        torch.set_num_threads(threads)
    rc, vc, mc = r.cuda(), v.cuda(), mask.cuda()
    ms = _bench(lambda: gae(rc, vc, gamma=0.99, lam=0.95, mask=mc), quick)
    rows.append(dict(method="gae_cuda", B=B, T=T, ms=ms, speedup=loop_ms / ms))
    for row in rows:
        print(f"gae {row['method']:>26}: {row['ms']:9.3f} ms", flush=True)
    yield from rows


def _median_ms(fn, n):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


# ----------------------------------------------------------------------------- ring tiles
def bench_ring_tile(quick):
    """Ring attention's block work on the Triton path, rank by rank, without communication:
    each rank's queries against every rank's keys (one Triton launch per block, fp32 merge by
    lse), forward and backward, on a zigzag plan of a packed causal stream; against
    single-device ``varlen_attention`` on the whole stream divided by the world size."""
    total = 4096 if quick else 32768
    for world in (2, 4):
        yield ring_block_work(total, world, "cuda", quick)


def ring_block_work(total, world, device, quick=False, heads=16, kv_heads=4, dim=128):
    """Per-rank time of the ring blocks (max over ranks) vs ``1 / world`` of one device's time."""
    from types import SimpleNamespace

    from rlhf_kernels.ring.blocks import backward_block_triton, forward_block_triton, segment_pairs
    from rlhf_kernels.ring.plan import RingPlan

    lengths = _lengths(total, total // 16, total // 4, seed=world)
    cu = torch.tensor([0, *_cumsum(lengths)], dtype=torch.int32, device=device)
    plan = RingPlan.build(cu.cpu(), world)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (
        torch.randn(total, h, dim, device=device, dtype=dtype, generator=g)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    spec = SimpleNamespace(scale=dim**-0.5, left=-1, right=0, softcap=0.0)
    shards = [[plan.shard(t, r) for t in (q, k, v, do)] for r in range(world)]
    pairs = [[segment_pairs(plan, r, s, -1, 0, device) for s in range(world)] for r in range(world)]

    def forward(r):
        qr = shards[r][0]
        o = torch.zeros(qr.shape, dtype=torch.float32, device=device)
        lse = torch.full((heads, qr.shape[0]), float("-inf"), device=device)
        for s in range(world):
            forward_block_triton(spec, qr, shards[s][1], shards[s][2], pairs[r][s], o, lse)
        return o, lse

    def backward(r, o, lse):
        qr, dor = shards[r][0], shards[r][3]
        delta = (o * dor.float()).sum(-1).t().contiguous()
        dq = torch.zeros(qr.shape, dtype=torch.float32, device=device)
        for s in range(world):
            dk = torch.zeros(shards[s][1].shape, dtype=torch.float32, device=device)
            dv = torch.zeros_like(dk)
            backward_block_triton(
                spec, qr, shards[s][1], shards[s][2], dor, lse, delta, pairs[r][s], dq, dk, dv
            )
        return dq

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        for x in leaves:
            x.grad = None
        varlen_attention(*leaves, cu, cu, causal=True, backend="triton").backward(do)

    # the blocks agree with single-device attention (rank 0's rows: out and dq)
    out = varlen_attention(q, k, v, cu, cu, causal=True, backend="triton")
    step()
    saved = [forward(r) for r in range(world)]
    want_out, want_dq = plan.shard(out, 0).float(), plan.shard(leaves[0].grad, 0).float()
    err = (saved[0][0].to(dtype).float() - want_out).abs().max().item()
    dq0 = backward(0, *saved[0]).to(dtype).float()
    err_dq = (dq0 - want_dq).abs().max().item()
    rel = [err / want_out.abs().max().item(), err_dq / want_dq.abs().max().item()]
    fwd = [_bench(lambda r=r: forward(r), quick) for r in range(world)]
    fb = [_bench(lambda r=r: backward(r, *saved[r]), quick) + f for r, f in enumerate(fwd)]
    single_f = _bench(
        lambda: varlen_attention(q, k, v, cu, cu, causal=True, backend="triton"), quick
    )

    single_fb = _bench(step, quick)
    flops = _causal_flops(lengths, heads, dim) / world  # one rank's share of the useful work
    row = dict(
        world=world, total=total, docs=len(lengths), heads=heads, kv_heads=kv_heads, dim=dim,
        rank_fwd_ms=fwd, rank_fwd_bwd_ms=fb, single_fwd_ms=single_f, single_fwd_bwd_ms=single_fb,
        fwd_tflops=flops / max(fwd) / 1e9, fwd_bwd_tflops=3.5 * flops / max(fb) / 1e9,
        fwd_vs_ideal=max(fwd) * world / single_f, fwd_bwd_vs_ideal=max(fb) * world / single_fb,
        max_err_out=err, max_err_dq=err_dq, rel_err_out=rel[0], rel_err_dq=rel[1],
        mismatch=_mismatch(rel),
    )  # fmt: skip
    print(
        f"ring blocks world={world} T={total}: slowest rank fwd {max(fwd):.3f} ms "
        f"({row['fwd_vs_ideal']:.2f}x ideal), fwd+bwd {max(fb):.3f} ms "
        f"({row['fwd_bwd_vs_ideal']:.2f}x ideal)",
        flush=True,
    )
    return row


# ----------------------------------------------------------------------------- report
def machine():
    import triton

    import rlhf_kernels
    from bench.report import VERSIONED, _git, _version
    from rlhf_kernels.ops.gae import _native_supports

    commit = os.environ.get("RLHF_KERNELS_COMMIT")  # for a copy of the tree without .git
    if not commit and _git("rev-parse", "--short", "HEAD"):
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        commit = _git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    p = torch.cuda.get_device_properties(0)
    return dict(
        gpu=torch.cuda.get_device_name(0),
        sms=p.multi_processor_count,
        memory_gib=round(p.total_memory / 2**30, 1),
        cpu_count=os.cpu_count(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        rlhf_kernels_commit=commit,  # None: unknown (no git, no RLHF_KERNELS_COMMIT)
        rlhf_kernels_version=rlhf_kernels.__version__,
        native_ext=rlhf_kernels.has_native_ext(),  # False: setup.py fell back (or no build)
        native_cuda_gae=_native_supports(torch.device("cuda"), "fused_gae"),
        versions={key: _version(dist) for key, dist in VERSIONED.items()}
        | {"liger_kernel": _version("liger-kernel")},
    )


def write_markdown(report, path):
    m = report["machine"]
    lines = [
        f"# GPU check: {m['gpu']}, {report['date']}",
        "",
        f"torch {m['torch']} (CUDA {m['cuda']}), triton {m['triton']}, Python {m['python']}, "
        f"commit {m['rlhf_kernels_commit']}. bf16; median of CUDA-event timings.",
        "",
        f"Native extension {m.get('native_ext')} (CUDA GAE {m.get('native_cuda_gae')}); "
        f"versions {json.dumps(m.get('versions'))}; started {report.get('started')}, budget "
        f"{report.get('budget_s')} s; seconds per part {json.dumps(report.get('part_s', {}))}.",
        "",
    ]
    att = [r for r in report.get("attention", []) if "error" not in r]
    failed = [r for rows in report.values() if isinstance(rows, list) for r in rows if "error" in r]
    if att:
        lines += [
            "## Packed causal attention (TFLOP/s; fwd+bwd counts the backward as 2.5x forward)",
            "",
            f"Rel. err: max |peer - reference| / max |reference| (out, dq); over {MISMATCH_REL} "
            "is flagged MISMATCH.",
            "",
            "| head_dim | pack | docs | method | fwd ms | fwd TFLOP/s | fwd+bwd ms "
            "| fwd+bwd TFLOP/s | rel. err out, dq |",
            "|--:|--:|---|---|--:|--:|--:|--:|---|",
        ]
        for r in att:
            lines.append(
                f"| {r['dim']} | {r['total']} | {r['docs']} {r.get('mix', '')} | {r['method']} | "
                f"{r['fwd_ms']:.3f} | "
                f"{r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | "
                f"{r['rel_err_out']:.2g}, {r['rel_err_dq']:.2g} vs {r['reference']}"
                f"{' MISMATCH' if r['mismatch'] else ''} |"
            )
        lines.append("")
    for key, title in (("linear", "linear_logprobs"), ("gae", "GAE"), ("ring_tile", "ring tile")):
        rows = report.get(key, [])
        if rows:
            lines += [f"## {title}", "", "```", *[json.dumps(r) for r in rows], "```", ""]
    if failed:
        lines += ["## Failed", "", "```", *[json.dumps(r) for r in failed], "```", ""]
    if report.get("unfinished"):
        lines += [f"Unfinished (interrupted or over the time budget): {report['unfinished']}", ""]
    path.write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument(
        "--only", nargs="+", default=list(PARTS), choices=list(PARTS), help="parts, in order"
    )
    ap.add_argument(
        "--budget-s",
        type=_seconds,
        default=None,
        help="start no new row after this many seconds (rows so far are kept); "
        "$GPU_CHECK_DEADLINE (a Unix time, set by make gpu-check) caps it",
    )
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    deadline = _deadline(os.environ.get("GPU_CHECK_DEADLINE", ""))  # make gpu-check's
    if deadline is not None and not math.isfinite(deadline):
        ap.error(
            f"$GPU_CHECK_DEADLINE must be a Unix time in seconds, got "
            f"{os.environ['GPU_CHECK_DEADLINE']!r}"
        )
    if not torch.cuda.is_available():
        print("gpu_check needs CUDA", file=sys.stderr)
        return 2
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name: a usage error, not a traceback
        ap.error(f"--out-dir {str(args.out_dir)!r}: {e.strerror}")
    now = datetime.datetime.now(datetime.timezone.utc)
    report = dict(
        date=now.date().isoformat(),
        started=now.isoformat(timespec="seconds"),
        quick=args.quick,
        parts=list(args.only),
        machine=machine(),
    )
    tag = report["machine"]["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
    # the time of day in the name: a second run the same day (say --only the unfinished parts)
    # must not replace the first one's file
    stem = args.out_dir / (
        f"gpu-check-{tag}{'-quick' if args.quick else ''}-{report['date']}-{now:%H%M%S}"
    )
    for n in range(2, 100):  # and two runs in one second neither
        if not Path(f"{stem}.json").exists():
            break
        stem = stem.with_name(f"{stem.name.rsplit('~', 1)[0]}~{n}")
    report["unfinished"] = list(args.only)
    budget = args.budget_s
    if deadline is not None:
        left = deadline - time.time()
        budget = left if budget is None else min(budget, left)
    report["budget_s"] = None if budget is None else round(budget)
    start = time.perf_counter()

    def over_budget():
        return budget is not None and time.perf_counter() - start > budget

    # every row is written as it comes: a crash, a kill or the budget keeps what was measured
    for name in args.only:
        if over_budget():
            continue
        t0, rows = time.perf_counter(), report.setdefault(name, [])
        try:
            for row in PARTS[name](args.quick):
                rows.append(row)
                _save(report, stem)
                if over_budget():
                    break
            else:
                report["unfinished"].remove(name)
        except Exception as err:  # one part failing does not lose the others
            rows.append(dict(error=repr(err)[:300]))
            report["unfinished"].remove(name)
        report.setdefault("part_s", {})[name] = round(time.perf_counter() - t0, 1)
        _save(report, stem)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
    _save(report, stem)
    print(f"{stem}.md")
    failed = any(_fails(r) for n in PARTS for r in report.get(n, []))
    return 1 if failed or report["unfinished"] else 0


def _deadline(text: str) -> float | None:
    """``$GPU_CHECK_DEADLINE`` as a Unix time: None when unset, NaN when not a number."""
    if not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _seconds(text: str) -> float:
    """``--budget-s``: finite and >= 0 (inf and NaN raised from ``round`` once the output folder
    was made; a negative budget started nothing and only said so in the exit status)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _mismatch(rel_errors) -> bool:
    return not all(e <= MISMATCH_REL for e in rel_errors)  # NaN and inf are mismatches too


def _fails(row) -> bool:
    """A row that makes the check fail: a mismatch, or an error of ours or of a whole part. A
    peer's own error (flex running out of memory at 128k) is reported, not a failure."""
    if row.get("mismatch"):
        return True
    return "error" in row and str(row.get("method", "ours")).startswith(("ours", "gae", "linear_"))


def _save(report, stem):
    """Both files through a temporary one: a failed write keeps the previous rows on disk."""
    tmp = Path(f"{stem}.json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, f"{stem}.json")
    write_markdown(report, Path(f"{stem}.md.tmp"))
    os.replace(f"{stem}.md.tmp", f"{stem}.md")


PARTS = dict(
    attention=bench_attention, linear=bench_linear, gae=bench_gae, ring_tile=bench_ring_tile
)


if __name__ == "__main__":
    raise SystemExit(main())
