"""Varlen (packed) causal attention: our backends against their peers on the SAME packed batch.

Groups ``attention-<mode>-<case>``; mode ``fwd`` or ``fwd_bwd`` (forward, then backward of a
fixed random output gradient). Methods:

- ``varlen_torch`` / ``varlen_triton`` / ``varlen_flash_attn``: ``varlen_attention(backend=...)``
  (Triton and flash-attn only on CUDA: the Triton interpreter is not a performance path).
- ``sdpa_loop``: one ``scaled_dot_product_attention(is_causal=True)`` call per sample.
- ``sdpa_padded``: the samples padded to the longest one, ``(B, H, L, D)``, causal + key-padding
  bool mask (padding is done once outside the timed region, as a padded model would).
- ``sdpa_dense_mask``: the whole pack as one sequence with a block-diagonal causal bool mask
  (the ``T x T`` mask is built outside the timed region).
- ``flex_doc_mask``: compiled ``flex_attention`` with a document-causal ``BlockMask`` (built
  outside the timed region; its build time is in ``extra_info``). Forward only on CPU.
- CUDA only: ``sdpa_flash_loop`` (per-sample SDPA forced to the flash backend) and
  ``torch_varlen_attn`` (``torch.nn.attention.varlen``).

Every method's output (and, for fwd_bwd, the query gradient) is checked against the torch
backend before timing, so the thing measured is the thing verified. ``extra_info`` holds the
shape, the useful causal FLOPs (``4 * sum(l^2) / 2 * heads * head_dim``, x3.5 for fwd_bwd: the
forward plus a backward of 2.5x), achieved TFLOP/s at the median, and on CUDA the peak memory
above what was already held.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from rlhf_kernels.ops.varlen_attention import varlen_attention

HEAD_DIM = 64
METHODS = (
    "varlen_torch",
    "varlen_triton",
    "varlen_flash_attn",
    "sdpa_loop",
    "sdpa_flash_loop",
    "torch_varlen_attn",
    "sdpa_padded",
    "sdpa_dense_mask",
    "flex_doc_mask",
)
MODES = ("fwd", "fwd_bwd")


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    heads: int
    kv_heads: int

    @property
    def total(self) -> int:
        return sum(self.lengths)


def uneven_lengths(total: int, lo: int, hi: int, seed: int = 0) -> tuple[int, ...]:
    """Lengths drawn uniformly in ``[lo, hi]`` until they sum to ``total`` (last one trimmed)."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return tuple(out)


def cases(quick: bool) -> list[Case]:
    n, seq, total, lo, hi = (4, 128, 1024, 16, 256) if quick else (16, 512, 8192, 32, 1024)
    return [
        Case(f"uniform{n}x{seq}", (seq,) * n, 8, 8),
        Case(f"uniform{n}x{seq}-gqa8to2", (seq,) * n, 8, 2),
        Case(f"uneven{total // 1024}k", uneven_lengths(total, lo, hi), 8, 8),
    ]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        from bench.conftest import is_quick

        cs = cases(is_quick(metafunc.config))
        metafunc.parametrize("case", cs, ids=[c.name for c in cs], scope="module")


def causal_flops(lengths, heads: int, dim: int, mode: str) -> float:
    """Useful (unmasked) causal FLOPs: two matmuls of 2*l*l*d each, half of them masked."""
    fwd = 4.0 * sum(x * x for x in lengths) / 2 * heads * dim
    return fwd * (3.5 if mode == "fwd_bwd" else 1.0)  # the step times forward + backward (2.5x)


# ----------------------------------------------------------------------------- shared batch
_BATCHES: dict = {}


def packed_batch(case: Case, device: torch.device, dtype: torch.dtype) -> dict:
    """One packed batch per case (shared by every method) plus the torch backend's answers."""
    key = (case, device.type, dtype)
    if key not in _BATCHES:
        g = torch.Generator().manual_seed(1234)
        t, h, kvh = case.total, case.heads, case.kv_heads
        q = torch.randn(t, h, HEAD_DIM, generator=g).to(device, dtype)
        k = torch.randn(t, kvh, HEAD_DIM, generator=g).to(device, dtype)
        v = torch.randn(t, kvh, HEAD_DIM, generator=g).to(device, dtype)
        dout = torch.randn(t, h, HEAD_DIM, generator=g).to(device, dtype)
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu.to(device)
        # ground truth: torch backend in fp32
        qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
        out = varlen_attention(qr, kr, vr, cu, cu, causal=True, backend="torch")
        out.backward(dout.float())
        _BATCHES[key] = dict(q=q, k=k, v=v, dout=dout, cu=cu, ref_out=out.detach(), ref_dq=qr.grad)
    return _BATCHES[key]


# ----------------------------------------------------------------------------- methods
class Skip(Exception):
    pass


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().clone().requires_grad_(grad)


def build(method: str, case: Case, batch: dict, mode: str):
    """Return ``(run, unpack_out, unpack_dq, leaves, dout, extra)``; ``run()`` is the timed
    forward; ``unpack_*`` map its output / q's gradient back to the packed ``(T, H, D)`` layout."""
    cuda = batch["q"].is_cuda
    grad = mode == "fwd_bwd"
    cu, lengths = batch["cu"], case.lengths
    cu_list = cu.tolist()
    gqa = case.heads != case.kv_heads
    q, k, v = (_leaf(batch[n], grad) for n in ("q", "k", "v"))
    ident = lambda t: t  # noqa: E731
    extra: dict = {}

    if method.startswith("varlen_"):
        backend = method[len("varlen_") :]
        if backend in ("triton", "flash_attn") and not cuda:
            why = "runs under the interpreter on CPU" if backend == "triton" else "needs CUDA"
            raise Skip(f"backend={backend!r} is CUDA-only as a performance path ({why})")
        if backend == "flash_attn":
            import importlib.util

            if importlib.util.find_spec("flash_attn") is None:
                raise Skip("flash-attn is not installed")
        maxlen = max(lengths)

        def run():
            return varlen_attention(q, k, v, cu, cu, maxlen, maxlen, causal=True, backend=backend)

        return run, ident, ident, (q, k, v), batch["dout"], extra

    if method in ("sdpa_loop", "sdpa_flash_loop"):
        if method == "sdpa_flash_loop" and not cuda:
            raise Skip("the SDPA flash backend is CUDA-only")

        def loop():
            outs = []
            for a, b in zip(cu_list[:-1], cu_list[1:]):
                qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs, 0)

        run = loop
        if method == "sdpa_flash_loop":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def run():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return loop()

        return run, ident, ident, (q, k, v), batch["dout"], extra

    if method == "torch_varlen_attn":
        if not cuda:
            raise Skip("torch.nn.attention.varlen is CUDA-only")
        from torch.nn.attention.varlen import varlen_attn

        maxlen = max(lengths)

        import inspect

        params = inspect.signature(varlen_attn).parameters  # changed across torch releases
        kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        if gqa and "enable_gqa" not in params:
            raise Skip("this torch's varlen_attn has no GQA")
        if gqa:
            kw["enable_gqa"] = True

        def run():
            return varlen_attn(q, k, v, cu, cu, maxlen, maxlen, **kw)

        return run, ident, ident, (q, k, v), batch["dout"], extra

    # token t of the pack sits at (sample b_idx[t], position i_idx[t])
    b_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i_idx = torch.arange(case.total) - torch.tensor(cu_list[:-1]).repeat_interleave(
        torch.tensor(lengths)
    )
    b_idx, i_idx = b_idx.to(q.device), i_idx.to(q.device)

    if method == "sdpa_padded":
        n, L = len(lengths), max(lengths)

        def pad(x):  # (T, h, D) -> (B, h, L, D)
            out = x.new_zeros(n, L, x.shape[1], x.shape[2])
            out[b_idx, i_idx] = x.detach()
            return out.transpose(1, 2).contiguous().requires_grad_(grad)

        qp, kp, vp = pad(q), pad(k), pad(v)
        pos = torch.arange(L, device=q.device)
        valid = pos[None, :] < torch.tensor(lengths, device=q.device)[:, None]  # (B, L) keys
        mask = (pos[None, :, None] >= pos[None, None, :]) & valid[:, None, :]  # (B, Lq, Lk)
        mask = mask.unsqueeze(1)  # (B, 1, L, L)
        dout = pad(batch["dout"]).detach()
        extra["padded_tokens"] = n * L

        def run():
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=gqa)

        def unpack(t):
            return t.transpose(1, 2)[b_idx, i_idx]

        return run, unpack, unpack, (qp, kp, vp), dout, extra

    if method == "sdpa_dense_mask":
        tok = torch.arange(case.total, device=q.device)
        mask = (b_idx[:, None] == b_idx[None, :]) & (tok[:, None] >= tok[None, :])  # (T, T)

        def run():
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
            return o[0].transpose(0, 1)

        return run, ident, ident, (q, k, v), batch["dout"], extra

    if method == "flex_doc_mask":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as e:
            raise Skip(f"flex_attention unavailable: {e}") from e
        if grad and not cuda:
            raise Skip(
                "compiled flex_attention has no backward on CPU (torch "
                f"{torch.__version__}: 'FlexAttention does not support backward on CPU')"
            )
        doc = b_idx

        def doc_causal(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi)

        t0 = time.perf_counter()
        block_mask = create_block_mask(
            doc_causal, None, None, case.total, case.total, device=q.device.type
        )
        extra["block_mask_build_s"] = time.perf_counter() - t0
        flex = torch.compile(flex_attention, dynamic=False)

        def run():
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = flex(qs, ks, vs, block_mask=block_mask, enable_gqa=gqa)
            return o[0].transpose(0, 1)

        return run, ident, ident, (q, k, v), batch["dout"], extra

    raise ValueError(f"unknown method {method!r}")


# ----------------------------------------------------------------------------- timing helpers
def make_step(run, leaves, dout, mode: str, sync):
    """The timed unit: forward (no autograd) or forward + backward, then a device sync."""

    def step():
        if mode == "fwd":
            with torch.no_grad():
                out = run()
        else:
            for t in leaves:
                t.grad = None
            out = run()
            out.backward(dout)
        sync()
        return out

    return step


def warm_and_verify(method, step, unpack_out, unpack_dq, leaves, batch, mode) -> float:
    """First call (compiles flex, fills caches), checked against the torch backend's answers.
    Returns its duration; raises Skip when an optional peer cannot run here."""
    t0 = time.perf_counter()
    try:
        out = step()
    except (RuntimeError, NotImplementedError) as e:
        if method in ("flex_doc_mask", "torch_varlen_attn"):
            raise Skip(f"{method} does not run here: {type(e).__name__}: {str(e)[:200]}") from e
        raise
    first = time.perf_counter() - t0
    tol = 3e-2 if out.dtype == torch.bfloat16 else 2e-4
    got = unpack_out(out.detach()).float()
    torch.testing.assert_close(got, batch["ref_out"], atol=tol, rtol=tol)
    if mode == "fwd_bwd":
        dq = unpack_dq(leaves[0].grad).float()
        torch.testing.assert_close(dq, batch["ref_dq"], atol=5 * tol, rtol=5 * tol)
    return first


def describe(case: Case, mode: str, method: str, dtype, device) -> dict:
    return dict(
        label=method,
        method=method,
        mode=mode,
        case=case.name,
        samples=len(case.lengths),
        tokens=case.total,
        max_len=max(case.lengths),
        heads=case.heads,
        kv_heads=case.kv_heads,
        head_dim=HEAD_DIM,
        dtype=str(dtype).replace("torch.", ""),
        device=device.type,
        causal_flops=causal_flops(case.lengths, case.heads, HEAD_DIM, mode),
    )


# ----------------------------------------------------------------------------- benchmark
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_varlen_attention(benchmark, case, mode, method, device, sync):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = packed_batch(case, device, dtype)
    try:
        run, unpack_out, unpack_dq, leaves, dout, extra = build(method, case, batch, mode)
        step = make_step(run, leaves, dout, mode, sync)
        extra["first_call_s"] = warm_and_verify(
            method, step, unpack_out, unpack_dq, leaves, batch, mode
        )
    except Skip as e:
        pytest.skip(str(e))

    if device.type == "cuda":  # peak above what is already held (cached batches, references)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    benchmark.group = f"attention-{mode}-{case.name}"
    benchmark(step)

    extra.update(describe(case, mode, method, dtype, device))
    if benchmark.stats is not None:  # None under --benchmark-disable
        extra["tflops_per_s"] = extra["causal_flops"] / benchmark.stats.stats.median / 1e12
    if device.type == "cuda":
        extra["peak_extra_mem_bytes"] = torch.cuda.max_memory_allocated() - held
    benchmark.extra_info.update(extra)


# ----------------------------------------------------------------------------- interleaved run
def interleaved(quick: bool, rounds: int, seed: int = 0) -> dict:
    """Time every runnable method of a (case, mode) round-robin, in a fresh random order each
    round, so that load from other processes on a shared machine hits all peers alike."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = random.Random(seed)
    results, skipped = [], []
    for case in cases(quick):
        batch = packed_batch(case, device, dtype)
        for mode in MODES:
            steps = {}
            for method in METHODS:
                try:
                    run, unpack_out, unpack_dq, leaves, dout, _ = build(method, case, batch, mode)
                    step = make_step(run, leaves, dout, mode, sync)
                    warm_and_verify(method, step, unpack_out, unpack_dq, leaves, batch, mode)
                except Skip as e:
                    skipped.append(
                        {"case": case.name, "mode": mode, "method": method, "reason": str(e)}
                    )
                    continue
                steps[method] = step
            times = {m: [] for m in steps}
            for _ in range(rounds):
                order = list(steps)
                rng.shuffle(order)
                for m in order:
                    t0 = time.perf_counter()
                    steps[m]()
                    times[m].append(time.perf_counter() - t0)
            base = statistics.median(times["varlen_torch"])
            for m, ts in times.items():
                med = statistics.median(ts)
                row = describe(case, mode, m, dtype, device)
                row.update(
                    median=med,
                    min=min(ts),
                    max=max(ts),
                    rounds=len(ts),
                    times=ts,
                    tflops_per_s=row["causal_flops"] / med / 1e12,
                    speedup_of_varlen_torch=med / base,
                )
                results.append(row)
                print(
                    f"{case.name:>24} {mode:>7} {m:>18} {med * 1e3:10.2f} ms  "
                    f"{med / base:5.2f}x varlen_torch's time",
                    flush=True,
                )
    return {"results": results, "skipped": skipped}


def main(argv=None) -> int:
    import argparse
    import datetime
    import json
    from pathlib import Path

    from bench.report import collect_machine_info, machine_tag

    ap = argparse.ArgumentParser(description="interleaved varlen attention comparison")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--force", action="store_true", help="overwrite today's results file")
    args = ap.parse_args(argv)
    info = collect_machine_info()
    date = datetime.date.today().isoformat()
    stem = f"attention-interleaved-{machine_tag(info)}{'-quick' if args.quick else ''}-{date}"
    path = args.out_dir / f"{stem}.json"
    if path.exists() and not args.force:  # before the timings (a finished run was lost)
        ap.error(f"{path} exists (committed results?): pass --force to overwrite")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "what": "varlen causal attention peers, timed round-robin (seconds per call)",
        "machine": info,
        "date": date,
        "quick": args.quick,
        "rounds": args.rounds,
        **interleaved(args.quick, args.rounds),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    plot_interleaved(data, args.out_dir / f"{stem}.png")
    print(path)
    return 0


def plot_interleaved(data: dict, path) -> None:
    """One panel per mode: grouped bars of median ms per case, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    case_names = list(dict.fromkeys(r["case"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(MODES), figsize=(13, 4.5))
    width = 0.8 / max(len(methods), 1)
    for ax, mode in zip(axes, MODES):
        for j, m in enumerate(methods):
            xs, ys = [], []
            for i, c in enumerate(case_names):
                hit = [r for r in rows if (r["case"], r["mode"], r["method"]) == (c, mode, m)]
                if hit:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    ys.append(hit[0]["median"] * 1e3)
            ax.bar(xs, ys, width, label=m)
        ax.set_xticks(range(len(case_names)), case_names, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("median time per call (ms, log scale)")
        ax.set_title(f"{mode}", fontsize=10)
    axes[0].legend(fontsize=8)
    m = data["machine"]
    fig.suptitle(
        f"varlen causal attention, heads 8, head_dim 64 | {m['gpu'] or m['cpu_model']} "
        f"({m['cpu_cores']} cores) | {data['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if not torch.cuda.is_available():
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
