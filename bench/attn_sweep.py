"""Block-size sweep of the Triton varlen attention kernels on CUDA (input to their tuning).

For each head_dim (64, 128) on a 32k-token causal pack of uneven documents, bf16, times the
forward kernel and the backward kernels (dK/dV + dQ) for each (BLOCK_M, BLOCK_N, warps, stages)
in a small grid (median ms per config), and prints the best. ``python bench/attn_sweep.py
[--total 32768] [--out FILE.json]``: ``--out`` also writes every row with the machine, versions,
commit and date.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import _lengths  # noqa: E402
from rlhf_kernels.ops import varlen_attention_triton as vt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=32768)
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--out", type=Path, default=None, help="write every row to this JSON file")
    args = ap.parse_args(argv)
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        ap.error(f"--out {str(args.out)!r}: not a file in an existing folder")  # before the sweep
    if not torch.cuda.is_available():
        sys.exit("attn_sweep.py needs a CUDA device")
    out = []
    for dim in args.dims:
        heads = 2048 // dim
        lengths = _lengths(args.total, args.total // 16, args.total // 4, seed=args.total + dim)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
        cu = cu.int()
        mx = max(lengths)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (
            torch.randn(args.total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)
        )
        flops = 2.0 * sum(n * n for n in lengths) * heads * dim
        o, lse = vt.varlen_attention_triton_forward(
            q, k, v, cu, cu, mx, mx, dim**-0.5, True, (-1, -1), 0.0
        )
        for backward in (False, True):
            out += _sweep(dim, heads, q, k, v, do, o, lse, cu, mx, flops, backward)
    for dim in args.dims:
        for backward in (False, True):
            rs = [r for r in out if r["dim"] == dim and r["backward"] == backward]
            if rs:
                best = sorted(rs, key=lambda r: r["ms"])[:3]
                print("BEST", dim, "bwd" if backward else "fwd", json.dumps(best))
    if args.out is not None:
        import datetime

        from bench.report import collect_machine_info

        args.out.write_text(
            json.dumps(
                dict(
                    machine=collect_machine_info(),
                    date=datetime.date.today().isoformat(),
                    command=" ".join(
                        ["bench/attn_sweep.py", *(sys.argv[1:] if argv is None else argv)]
                    ),
                    rows=out,
                ),
                indent=1,
            )
            + "\n"
        )


def _fixed(cfg):
    return lambda *args, **kwargs: cfg


def _sweep(dim, heads, q, k, v, do, o, lse, cu, mx, flops, backward):
    from triton.testing import do_bench

    rows = []
    args = (q, k, v, cu, cu, mx, mx, dim**-0.5, True, (-1, -1), 0.0)
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
        vt._FITTING_BLOCKS.clear()
        vt._block_sizes = _fixed((bm, bn, warps, stages))
        if backward:
            fn = lambda: vt.varlen_attention_triton_backward(do, *args[:3], o, lse, *args[3:])
        else:
            fn = lambda: vt.varlen_attention_triton_forward(*args)
        try:
            ms = float(do_bench(fn, warmup=3, rep=15, return_mode="median"))
        except Exception as err:  # out of resources, compile failure
            print(f"D={dim} bwd={backward} {bm}x{bn} w{warps} s{stages}: {err!r:.80}")
            continue
        tf = (2.5 if backward else 1.0) * flops / ms / 1e9
        used = sorted(set(vt._FITTING_BLOCKS.values()))  # after any shared-memory fallback
        row = dict(dim=dim, backward=backward, bm=bm, bn=bn, warps=warps, stages=stages,
                   ms=ms, tflops=tf, used=used)  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
