"""RL math ops against their naive / Python-loop peers, on the same inputs.

Groups (pytest-benchmark, ``rl_math-<op>``), each method checked against the peer first:

- ``linear_logprobs``: fused lm_head + log-prob vs ``log_softmax(h @ W.T).gather`` (fwd + bwd of
  ``sum(logp * w)``), ``linear_nll_loss`` vs ``F.cross_entropy(h @ W.T)``, and
  ``linear_policy_loss`` vs ``policy_loss`` on the naive log-probs (fwd + bwd).
- ``logprobs``: ``logprobs_from_logits(..., return_entropy=True)`` vs OpenRLHF's recipe
  (``logits.float()``, ``log_softmax``, gather, entropy from the fp32 copy), fwd + bwd.
- ``gae`` / ``returns``: ``fused_native`` (the fused native op: mask, delta, scan and returns in
  one pass per row), ``scan_torch`` / ``scan_triton`` (delta in torch + that backend's scan) vs
  the classic reversed-time Python loop, padded B=64, T=1024, forward.
- ``group_adv`` / ``policy_loss``: vectorised ops vs per-group / per-sequence Python loops.

``python bench/bench_rl_math.py`` runs every (case, method) in a fresh subprocess, measures the
median and best time and the peak extra resident memory of one fwd+bwd
(``/proc/self/clear_refs`` = 5 resets VmHWM after the inputs exist; peak = VmHWM - VmRSS at that
point), and writes
``bench/results/rl_math-<machine>-<date>.json`` + ``.png``. With CUDA it measures
``torch.cuda.max_memory_allocated`` instead and adds the large GPU linear case.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "TRITON_INTERPRET" not in os.environ:
    import torch as _t  # noqa: F401  (decide before triton is imported)

    if not _t.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import (  # noqa: E402
    collect_machine_info,
    machine_tag,
    proc_memory_kb,
    reset_peak_rss,
    results_stem,
    script_args,
)
from rlhf_kernels.ops.advantages import group_advantages  # noqa: E402
from rlhf_kernels.ops.gae import (  # noqa: E402
    discounted_returns,
    gae,
)
from rlhf_kernels.ops.gae import discounted_returns_reference as loop_returns  # noqa: E402
from rlhf_kernels.ops.gae import gae_reference as loop_gae  # noqa: E402
from rlhf_kernels.ops.linear_logprobs import (  # noqa: E402
    linear_logprobs,
    linear_nll_loss,
    linear_policy_loss,
)
from rlhf_kernels.ops.logprobs import logprobs_from_logits  # noqa: E402
from rlhf_kernels.ops.losses import policy_loss  # noqa: E402

# ----------------------------------------------------------------------------- peers


def loop_group_grpo(rewards, G):
    out = torch.empty_like(rewards)
    for i in range(0, rewards.numel(), G):
        grp = rewards[i : i + G]
        out[i : i + G] = (grp - grp.mean()) / (grp.std() + 1e-6)
    return out


def loop_policy_loss(logp, old, adv, cu):
    per_seq = []
    for s, e in zip(cu[:-1], cu[1:]):
        r = torch.exp(logp[s:e] - old[s:e])
        a = adv[s:e]
        per_seq.append(torch.maximum(-a * r, -a * r.clamp(0.8, 1.2)).mean())
    return torch.stack(per_seq).mean()


# ----------------------------------------------------------------------------- workloads
def _linear_inputs(T, H, V, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    return h, w, labels


def make_case(case: str, method: str, quick: bool = False, device: str = "cpu"):
    """Build inputs; return (run: () -> tensors to compare, meta dict). run includes backward."""
    dev = torch.device(device)
    if case.startswith("linear"):
        if case == "linear_gpu":
            T, H, V, dtype = 32768, 4096, 131072, torch.bfloat16
        else:
            T, H, V, dtype = (
                (512, 64, 4096, torch.float32) if quick else (4096, 128, 32768, torch.float32)
            )
        h, w, labels = _linear_inputs(T, H, V, dtype, dev)
        g1 = torch.Generator().manual_seed(1)
        wt = torch.rand(T, generator=g1).to(dev)
        old = (torch.randn(T, generator=g1) * 0.3 - math.log(V)).to(dev)  # near-uniform policy
        adv = torch.randn(T, generator=g1).to(dev)
        cu = torch.arange(0, T + 1, max(1, T // 8), device=dev)
        cu[-1] = T

        def grads(loss):
            h.grad = w.grad = None
            loss.backward()
            return loss.detach().float(), h.grad, w.grad

        fns = {
            "naive_logsoftmax_gather": lambda: grads(
                (
                    torch.log_softmax((h @ w.T).float(), -1).gather(1, labels[:, None])[:, 0] * wt
                ).sum()
            ),
            "linear_logprobs": lambda: grads((linear_logprobs(h, w, labels) * wt).sum()),
            "naive_cross_entropy": lambda: grads(F.cross_entropy((h @ w.T).float(), labels)),
            "linear_nll_loss": lambda: grads(linear_nll_loss(h, w, labels)),
            "naive_policy_loss": lambda: grads(
                policy_loss(
                    torch.log_softmax((h @ w.T).float(), -1).gather(1, labels[:, None])[:, 0],
                    old,
                    adv,
                    cu_seqlens=cu,
                    aggregation="seq-mean-token-mean",
                )
            ),
            "linear_policy_loss": lambda: grads(
                linear_policy_loss(
                    h, w, labels, old, adv, cu_seqlens=cu, aggregation="seq-mean-token-mean"
                )
            ),
        }
        peer = {
            "linear_logprobs": "naive_logsoftmax_gather",
            "linear_nll_loss": "naive_cross_entropy",
            "linear_policy_loss": "naive_policy_loss",
        }.get(method, method)
        return fns[method], fns[peer], dict(T=T, H=H, V=V, dtype=str(dtype), peer=peer)
    if case == "logprobs":
        R, V = (256, 4096) if quick else (2048, 32768)
        g = torch.Generator().manual_seed(0)
        z = (torch.randn(R, V, generator=g) * 2).to(dev, torch.bfloat16).requires_grad_()
        labels = torch.randint(0, V, (R,), generator=g).to(dev)
        wl, we = torch.randn(R, generator=g).to(dev), torch.randn(R, generator=g).to(dev)

        def naive():
            z.grad = None
            lp_all = torch.log_softmax(z.float(), -1)
            lp = lp_all.gather(1, labels[:, None])[:, 0]
            ent = -(torch.softmax(z.float(), -1) * lp_all).sum(-1)
            ((lp * wl).sum() + (ent * we).sum()).backward()
            return lp.detach(), ent.detach(), z.grad

        def ours():
            z.grad = None
            lp, ent = logprobs_from_logits(z, labels, return_entropy=True)
            ((lp * wl).sum() + (ent * we).sum()).backward()
            return lp.detach(), ent.detach(), z.grad

        fns = {"openrlhf_fp32_logits": naive, "logprobs_from_logits": ours}
        return fns[method], naive, dict(R=R, V=V, dtype="bfloat16", peer="openrlhf_fp32_logits")
    if case in ("gae", "returns"):
        B, T = (16, 256) if quick else (64, 1024)
        g = torch.Generator().manual_seed(0)
        r, v = torch.randn(B, T, generator=g).to(dev), torch.randn(B, T, generator=g).to(dev)
        lens = torch.randint(T // 2, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lens[:, None]).float().to(dev)
        if case == "gae":
            fns = {"python_loop": lambda: loop_gae(r, v, mask, 0.99, 0.95)}
            fns["fused_native"] = lambda: gae(
                r, v, gamma=0.99, lam=0.95, mask=mask, backend="native"
            )
            for b in ("torch", "triton"):
                fns[f"scan_{b}"] = lambda b=b: gae(r, v, gamma=0.99, lam=0.95, mask=mask, backend=b)
        else:
            fns = {"python_loop": lambda: (loop_returns(r, mask, 0.99),)}
            fns["fused_native"] = lambda: (
                discounted_returns(r, gamma=0.99, mask=mask, backend="native"),
            )
            for b in ("torch", "triton"):
                fns[f"scan_{b}"] = lambda b=b: (
                    discounted_returns(r, gamma=0.99, mask=mask, backend=b),
                )
        return fns[method], fns["python_loop"], dict(B=B, T=T, peer="python_loop")
    if case == "group_adv":
        N, G = (512, 8) if quick else (4096, 8)
        r = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(dev)
        fns = {
            "python_loop": lambda: (loop_group_grpo(r, G),),
            "group_advantages": lambda: (group_advantages(r, G, "grpo"),),
        }
        return fns[method], fns["python_loop"], dict(N=N, G=G, peer="python_loop")
    if case == "policy_loss":
        S = 16 if quick else 64
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(200, 1200, (S,), generator=g)
        cu = [0] + lens.cumsum(0).tolist()
        N = cu[-1]
        logp = (torch.randn(N, generator=g) * 0.1 - 1).to(dev).requires_grad_()
        old = logp.detach() + 0.1 * torch.randn(N, generator=g).to(dev)
        adv = torch.randn(N, generator=g).to(dev)
        cu_t = torch.tensor(cu, device=dev)

        def run(f):
            logp.grad = None
            loss = f()
            loss.backward()
            return loss.detach(), logp.grad

        fns = {
            "python_loop": lambda: run(lambda: loop_policy_loss(logp, old, adv, cu)),
            "policy_loss": lambda: run(
                lambda: policy_loss(
                    logp, old, adv, cu_seqlens=cu_t, aggregation="seq-mean-token-mean"
                )
            ),
        }
        return fns[method], fns["python_loop"], dict(N=N, S=S, peer="python_loop")
    raise ValueError(f"unknown case {case!r}")


CASES = {
    "linear": [
        "naive_logsoftmax_gather",
        "linear_logprobs",
        "naive_cross_entropy",
        "linear_nll_loss",
        "naive_policy_loss",
        "linear_policy_loss",
    ],
    "logprobs": ["openrlhf_fp32_logits", "logprobs_from_logits"],
    "gae": ["python_loop", "fused_native", "scan_torch", "scan_triton"],
    "returns": ["python_loop", "fused_native", "scan_torch", "scan_triton"],
    "group_adv": ["python_loop", "group_advantages"],
    "policy_loss": ["python_loop", "policy_loss"],
}


def _available(method: str, device: str) -> bool:
    from rlhf_kernels.ops import gae as gae_mod

    if method == "scan_triton":
        return device == "cuda"  # the interpreter is not a performance path
    if method == "fused_native":  # gae(backend="native") runs the fused op where it is built
        return gae_mod._native_supports(torch.device(device), "fused_gae")
    return True


def _check(out, ref, meta):
    low = "bfloat16" in meta.get("dtype", "")
    for o, r in zip(out, ref):
        if o is None:
            continue
        tol = 2e-2 if low else 1e-4
        torch.testing.assert_close(o.float(), r.float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- pytest-benchmark
PARAMS = [(c, m) for c, ms in CASES.items() for m in ms]


@pytest.mark.parametrize("case,method", PARAMS, ids=[f"{c}-{m}" for c, m in PARAMS])
def test_rl_math(benchmark, case, method, quick, device, sync, cpu_threads):
    if not _available(method, device.type):
        pytest.skip(f"{method} not a performance path on {device.type}")
    run, peer, meta = make_case(case, method, quick, device.type)
    _check(run(), peer(), meta)
    benchmark.group = f"rl_math-{case}"
    benchmark.extra_info.update(meta, torch_threads=torch.get_num_threads())
    benchmark.pedantic(
        lambda: (run(), sync()), rounds=3 if case == "linear" else 5, warmup_rounds=1
    )


@pytest.fixture
def cpu_threads(device):
    """The thread count of the standalone run (``RL_MATH_THREADS``, default 1) on CPU, as the
    results and READMEs state; restored afterwards."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(_threads())
    yield
    torch.set_num_threads(before)


def _threads() -> int:
    return int(os.environ.get("RL_MATH_THREADS", "1"))


# ----------------------------------------------------------------------------- standalone
def worker(case: str, method: str, device: str, quick: bool) -> dict:
    """One (case, method) in this process: check vs peer, peak extra memory, median time."""
    if device == "cpu":  # oversubscribed shared cores stall multi-threaded parallel regions
        torch.set_num_threads(_threads())
    run, peer, meta = make_case(case, method, quick, device)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        sync()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        total_peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        base = reset_peak_rss()
        run()
        peak_mb = (proc_memory_kb()["VmHWM"] - base) / 1024
        total_peak_mb = proc_memory_kb()["VmHWM"] / 1024
    if method != meta["peer"] and not case.endswith("_gpu"):
        _check(run(), peer(), meta)
    times = []
    budget = time.perf_counter() + (20 if case.startswith("linear") else 5)
    while len(times) < 3 or (time.perf_counter() < budget and len(times) < 30):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return dict(
        case=case,
        method=method,
        meta=meta,
        time_ms=statistics.median(times) * 1e3,
        time_ms_min=min(times) * 1e3,
        times_ms=[t * 1e3 for t in times],
        peak_extra_mb=peak_mb,
        peak_total_mb=total_peak_mb,
    )


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        case, method, device, quick = argv[1], argv[2], argv[3], argv[4] == "1"
        print("RESULT " + json.dumps(worker(case, method, device, quick)))
        return 0
    cli = script_args(argv, __doc__)
    quick = cli.quick
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = collect_machine_info()
    tag = machine_tag(info)
    out = results_stem(f"rl_math-{tag}", quick, cli.force)
    cases = dict(CASES)
    if device == "cuda" and not quick:
        cases = {
            "linear_gpu": [
                "naive_cross_entropy",
                "linear_nll_loss",
                "naive_logsoftmax_gather",
                "linear_logprobs",
            ],
            **cases,
        }
    results = []
    for case, methods in cases.items():
        for m in methods:
            if not _available(m, device):
                continue
            cmd = [sys.executable, __file__, "--worker", case, m, device, "1" if quick else "0"]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if res.returncode or not line:
                print(f"{case}/{m} failed:\n{res.stderr[-2000:]}", flush=True)
                results.append(dict(case=case, method=m, error=res.stderr[-500:]))
                continue
            r = json.loads(line[0][7:])
            results.append(r)
            print(
                f"{case:12s} {m:26s} {r['time_ms']:10.2f} ms (best {r['time_ms_min']:.2f})  peak "
                f"{r['peak_extra_mb']:9.1f} MiB",
                flush=True,
            )
    by = {(r["case"], r["method"]): r for r in results if "error" not in r}
    ratios = {}
    for (case, m), r in by.items():
        peer = by.get((case, r["meta"]["peer"]))
        if peer and m != r["meta"]["peer"]:
            ratios[f"{case}/{m}"] = dict(
                peer=r["meta"]["peer"],
                time_ratio=r["time_ms_min"] / peer["time_ms_min"],
                speedup=peer["time_ms_min"] / r["time_ms_min"],
                time_ratio_median=r["time_ms"] / peer["time_ms"],
                memory_ratio=(
                    r["peak_extra_mb"] / peer["peak_extra_mb"]
                    if peer["peak_extra_mb"] > 1
                    else None
                ),
            )
    date = _dt.date.today().isoformat()
    report = dict(
        group="rl_math",
        date=date,
        quick=quick,
        machine=dict(
            tag=tag,
            platform=platform.platform(),
            cpu_model=info["cpu_model"],
            cpu_count=os.cpu_count(),
            gpu=info["gpu"],
            load_avg_1min=os.getloadavg()[0],  # other jobs on the machine show here
        ),
        versions=dict(**info["versions"], python=platform.python_version()),
        rlhf_kernels=dict(git_commit=info["git_commit"], git_dirty=info["git_dirty"]),
        command=" ".join(["python", "bench/bench_rl_math.py", *argv]),
        cpu_threads=int(os.environ.get("RL_MATH_THREADS", "1")) if device == "cpu" else None,
        method=(
            "each (case, method) in a fresh subprocess; time = median wall time of repeated "
            "calls (fwd+bwd where the case has a backward; gae, returns and group_adv are "
            "forward only) after one checked call; peak_extra_mb = "
            + (
                "VmHWM - VmRSS around one fwd+bwd, VmHWM reset via /proc/self/clear_refs=5 "
                "after the inputs exist (includes the gradients both methods need)"
                if device == "cpu"
                else "torch.cuda.max_memory_allocated - memory_allocated before one fwd+bwd"
            )
        ),
        results=results,
        ratios=ratios,
    )
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    where = info["gpu"] or f"{info['cpu_model']} ({os.cpu_count()} cores)"
    commit = (info["git_commit"] or "unknown")[:7]
    _plot(results, out.with_suffix(".png"), f"rl_math | {where} | {date} | {commit}")
    print(json.dumps(ratios, indent=1))
    return 0


def _plot(results, path, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    cases = list(dict.fromkeys(r["case"] for r in ok))
    fig, axes = plt.subplots(2, len(cases), figsize=(3.2 * len(cases), 6), squeeze=False)
    for i, c in enumerate(cases):
        rs = [r for r in ok if r["case"] == c]
        names = [r["method"] for r in rs]
        times = [r["time_ms"] for r in rs]
        axes[0, i].barh(names, times, color="tab:blue")  # linear: bar length tracks time
        for y, t in enumerate(times):
            axes[0, i].text(t, y, f" {t:.3g}", va="center", fontsize=7)
        axes[0, i].margins(x=0.3)
        axes[0, i].set_title(f"{c}: median time (ms)", fontsize=9)
        axes[1, i].barh(names, [max(r["peak_extra_mb"], 0.0) for r in rs], color="tab:orange")
        axes[1, i].set_title(f"{c}: peak extra MiB", fontsize=9)
        for ax in axes[:, i]:
            ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
