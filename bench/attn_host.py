"""Host time of a packed attention call on CUDA: where small packs stop being kernel-bound.

For causal bf16 packs of uneven documents (``gpu_check``'s lengths; 2048 = heads x head_dim),
times ``varlen_attention(backend="triton")`` with the flat schedule built by its one-launch
kernel (``kernel``, the default) and by the torch reference of before (``torch``), with
``RLHF_KERNELS_AUTOTUNE=1`` (``autotuned``: the row records the blocks it kept per kernel), with
``RLHF_KERNELS_HEAD_SECTION=all`` (``all_heads``: the grid order before head sections, every
head of a slot in flight together; rows record the forward's heads per section), next
to ``torch.nn.attention.varlen.varlen_attn`` (``varlen_attn``: FlashAttention kernels inside
torch) when present. Per row: ``do_bench`` median ms of the forward and of forward+backward, and
the host time per call (``--calls`` calls enqueued back to back after a sync, before the
closing sync): when host >= median the call is host-bound.

``python bench/attn_host.py [--totals 8192 32768] [--methods kernel varlen_attn]
[--out-dir DIR]`` writes ``attn-host-<gpu>-<date>-<HHMMSS>.json`` there (hardware, versions,
commit from ``$RLHF_KERNELS_COMMIT`` or git, the command line) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import _bench, _cumsum, _lengths  # noqa: E402
from bench.report import collect_machine_info  # noqa: E402
from rlhf_kernels.ops import attention_schedule  # noqa: E402
from rlhf_kernels.ops import varlen_attention_triton as vt  # noqa: E402
from rlhf_kernels.ops.varlen_attention import varlen_attention  # noqa: E402


def _host_ms(fn, calls):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) * 1e3 / calls
    torch.cuda.synchronize()
    return host


METHODS = ("kernel", "torch", "autotuned", "all_heads", "varlen_attn")


def _picks(total, dim):
    """The blocks autotuning kept for this pack size and head dim, per kernel."""
    size, block_d = triton.next_power_of_2(total), vt._block_d(dim)
    # cache key: (kernel name, device, dtype, requested blocks, constexprs, pack size)
    return {
        name: list(blocks)
        for (name, *_, meta, key_size), blocks in vt._FITTING_BLOCKS.items()
        if key_size == size and dict(meta).get("BLOCK_D") == block_d
    }


def _rows(total, dim, calls, wanted):
    heads = 2048 // dim
    lengths = _lengths(total, total // 16, total // 4, seed=total + dim)
    cu = torch.tensor([0, *_cumsum(lengths)], dtype=torch.int32, device="cuda")
    n = max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    built = attention_schedule.flat_schedule
    saved = {e: os.environ.get(e) for e in ("RLHF_KERNELS_AUTOTUNE", "RLHF_KERNELS_HEAD_SECTION")}
    for name in wanted:
        if name != "varlen_attn":
            use_torch = name == "torch"
            attention_schedule.flat_schedule = (
                attention_schedule.flat_schedule_reference if use_torch else built
            )
            os.environ["RLHF_KERNELS_AUTOTUNE"] = "1" if name == "autotuned" else "0"
            os.environ["RLHF_KERNELS_HEAD_SECTION"] = "all" if name == "all_heads" else "auto"

            def fwd(a=q, b=k, c=v):
                return varlen_attention(a, b, c, cu, cu, n, n, causal=True, backend="triton")
        else:
            import inspect

            try:
                from torch.nn.attention.varlen import varlen_attn
            except ImportError:
                continue

            params = inspect.signature(varlen_attn).parameters
            kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}

            def fwd(a=q, b=k, c=v, kw=kw):
                return varlen_attn(a, b, c, cu, cu, n, n, **kw)

        def step():
            for x in leaves:
                x.grad = None
            fwd(*leaves).backward(do)

        try:
            step()
            row = dict(total=total, dim=dim, heads=heads, docs=len(lengths), method=name)
            row["fwd_ms"] = _bench(fwd)
            row["fwd_host_ms"] = _host_ms(fwd, calls)
            row["fwd_bwd_ms"] = _bench(step)
            row["fwd_bwd_host_ms"] = _host_ms(step, calls)
            if name == "autotuned":
                row["picks"] = _picks(total, dim)
            if name != "varlen_attn":
                row["fwd_heads_per_section"] = vt._head_section(
                    q.device, heads, 1, 4 * q[:, 0].numel()
                )
        except Exception as e:  # report and go on
            row = dict(total=total, dim=dim, method=name, error=repr(e)[:300])
        finally:
            attention_schedule.flat_schedule = built
            for e, val in saved.items():
                os.environ.pop(e, None)
                if val is not None:
                    os.environ[e] = val
        print(json.dumps(row), flush=True)
        yield row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--totals", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--calls", type=int, default=20, help="calls enqueued per host timing")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attn_host.py needs a CUDA device")
    try:  # before the timings: the file is written once, at the end
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out-dir {str(args.out_dir)!r}: {e.strerror}")

    args_given = sys.argv[1:] if argv is None else argv
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name()
    info = collect_machine_info()
    report = dict(
        gpu=gpu, date=now.isoformat(timespec="seconds"), torch=torch.__version__,
        triton=triton.__version__, cuda=torch.version.cuda, versions=info["versions"],
        commit=os.environ.get("RLHF_KERNELS_COMMIT") or info["git_commit"] or "unknown",
        git_dirty=info["git_dirty"], command=" ".join(["bench/attn_host.py", *args_given]),
        head_section=os.environ.get("RLHF_KERNELS_HEAD_SECTION"), rows=[],
    )  # fmt: skip
    for total in args.totals:
        for dim in args.dims:
            report["rows"].extend(_rows(total, dim, args.calls, args.methods))
    slug = gpu.lower().replace("nvidia ", "").replace(" ", "-")
    path = args.out_dir / f"attn-host-{slug}-{now:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'pack':>10} {'method':>22} {'fwd ms':>8} {'host':>7} {'fwd+bwd':>8} {'host':>7}")
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['total']:>6} d{r['dim']:<3} {r['method']:>22} error {r['error']}")
            continue
        print(
            f"{r['total']:>6} d{r['dim']:<3} {r['method']:>22} {r['fwd_ms']:8.3f} "
            f"{r['fwd_host_ms']:7.3f} {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_host_ms']:7.3f}"
            + (f"  picks {r['picks']}" if "picks" in r else "")
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
