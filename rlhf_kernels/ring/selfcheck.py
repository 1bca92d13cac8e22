"""Ring attention smoke check and timing on a real launch (torchrun; NCCL on GPUs, else gloo).

The world is cut into rings of ``--ring-size`` consecutive ranks (data parallel x ring). Every
ring builds a random packed stream of uneven documents, runs ``ring_varlen_attention`` forward and
backward on its shards, and compares them with single-device ``varlen_attention`` on the whole
stream (computed on every rank; skip with ``--no-reference`` at lengths one device cannot hold)
and with a ground truth one dtype wider. It prints PASS when every rank's errors are within the
tolerance of :func:`verdict` (at most twice single device's error), else FAIL and exits 1.

One node, 8 GPUs, two rings of 4::

    torchrun --nproc-per-node 8 -m rlhf_kernels.ring.selfcheck --ring-size 4 --total 131072

Two nodes (run on each, ``NODE_RANK`` = 0 / 1, ``MASTER`` = node 0's address), one ring of 16::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
        --rdzv-backend c10d --rdzv-endpoint $MASTER:29500 \\
        -m rlhf_kernels.ring.selfcheck --ring-size 16 --comm p2p --dtype bf16

Rings should sit inside a node where possible (NVLink); ``--comm allgather`` suits interconnects
that favour collectives over point-to-point.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from rlhf_kernels.ops.varlen_attention import varlen_attention
from rlhf_kernels.ring.attention import ring_varlen_attention
from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.validate import group_rank

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ring_group(ring_size: int):
    """This rank's ring: consecutive ranks ``[i * ring_size, (i + 1) * ring_size)``.

    Every rank must call this (``new_group`` is collective). Returns ``(group, ring_index)``;
    group is None when the ring is the whole world.
    """
    world = dist.get_world_size()
    if ring_size < 1 or world % ring_size:
        raise ValueError(f"ring_size must divide the world size {world}, got {ring_size}")
    if ring_size == world:
        return None, 0
    mine = None
    for i in range(world // ring_size):
        g = dist.new_group(list(range(i * ring_size, (i + 1) * ring_size)))
        if dist.get_rank() // ring_size == i:
            mine = g
    return mine, dist.get_rank() // ring_size


def check(
    ring_size: int,
    total: int = 4096,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: str = "fp32",
    layout: str = "zigzag",
    comm: str = "p2p",
    iters: int = 3,
    reference: bool = True,
    device: str | None = None,
) -> dict:
    """Run the check on an initialised process group; returns this rank's results.

    Keys: ``ring_s`` median fwd+bwd time, ``local_len``, ``balance`` (causal work max/mean);
    with ``reference`` also ``single_s`` (single-device time on the whole stream),
    ``out``/``dq``/``dk``/``dv`` (max abs difference from single device), ``errors`` (per tensor:
    the ring's and single device's max abs error against a wider-dtype ground truth, and the
    tolerance, see :func:`verdict`) and ``ok``.
    """
    if iters < 1:  # the median of no timed step
        raise ValueError(f"iters must be >= 1, got {iters}")
    if total < 1:  # (randperm would name a "negative dimension")
        raise ValueError(f"total must be >= 1 token, got {total}")
    group, ring_index = ring_group(ring_size)
    rank, _ = group_rank(group)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = _DTYPES[dtype]
    g = torch.Generator().manual_seed(1000 + ring_index)  # same stream on every rank of a ring
    n_docs = max(3, total // 4096)
    cuts = sorted(torch.randperm(total - 1, generator=g)[: n_docs - 1].add(1).tolist())
    cu = torch.tensor([0, *cuts, total], dtype=torch.int32)
    full = [
        torch.randn(total, h, head_dim, generator=g).to(dev, dt)
        for h in (heads, kv_heads, kv_heads, heads)
    ]
    plan = RingPlan.build(cu, ring_size, layout)
    q, k, v = (plan.shard(t, rank).requires_grad_() for t in full[:3])
    do = plan.shard(full[3], rank)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def ring_step():
        q.grad = k.grad = v.grad = None
        out = ring_varlen_attention(q, k, v, plan, group=group, comm=comm)
        out.backward(do)
        return out

    times = []
    for i in range(iters + 1):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        out = ring_step()
        sync()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    res = {
        "ring_s": sorted(times)[len(times) // 2],
        "local_len": plan.local_len,
        "balance": float((w := plan.attention_work(True).double()).max() / w.mean()),
    }
    if reference:
        ref_in = [t.detach().clone().requires_grad_() for t in full[:3]]
        cu_dev = cu.to(dev)
        for _ in range(2):  # second run timed, first one warms up
            sync()
            t0 = time.perf_counter()
            for t in ref_in:
                t.grad = None
            ref = varlen_attention(*ref_in, cu_dev, cu_dev, causal=True)
            ref.backward(full[3])
            sync()
            res["single_s"] = time.perf_counter() - t0
        # ground truth: the torch backend one dtype wider (fp32 for half types, fp64 for fp32)
        wide = torch.float64 if dt == torch.float32 else torch.float32
        truth_in = [t.detach().to(wide).requires_grad_() for t in full[:3]]
        truth = varlen_attention(*truth_in, cu_dev, cu_dev, causal=True, backend="torch")
        truth.backward(full[3].to(wide))
        res["errors"], res["ok"] = {}, True
        for name, a, b, c in zip(
            ("out", "dq", "dk", "dv"),
            (out, q.grad, k.grad, v.grad),
            (ref, *(t.grad for t in ref_in)),
            (truth, *(t.grad for t in truth_in)),
        ):
            b, c = plan.shard(b, rank), plan.shard(c, rank)
            res[name] = (a.float() - b.float()).abs().max().item()
            ok, res["errors"][name] = verdict(a, b, c, dt)
            res["ok"] &= ok
    return res


def verdict(ring, single, truth, dtype) -> tuple[bool, tuple[float, float, float]]:
    """Whether the ring result is as accurate as single-device attention in the same dtype.

    ``ring`` / ``single`` are compared with ``truth`` (a wider dtype): the ring's max abs error
    must be at most twice single device's, plus a floor of 64 fp32 epsilons at the result's
    scale (fp32 accumulation-order noise: both errors are ~0 in fp32, and the ring merges its
    tiles in another order). Returns
    ``(ok, (ring error, single-device error, tolerance))``.
    """
    truth = truth.double()
    err = (ring.double() - truth).abs().max().item()
    ref_err = (single.double() - truth).abs().max().item()
    tol = 2 * ref_err + 64 * torch.finfo(torch.float32).eps * max(1.0, truth.abs().max().item())
    return err <= tol, (err, ref_err, tol)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ring-size", type=int, default=None, help="default: the whole world")
    p.add_argument("--total", type=int, default=16384, help="tokens in each ring's stream")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--comm", choices=("p2p", "allgather"), default="p2p")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-reference", action="store_true")
    args = p.parse_args(argv)
    if args.ring_size is not None and args.ring_size < 1:  # 0 is not "the whole world"
        p.error(f"--ring-size must be >= 1, got {args.ring_size}")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        res = check(
            dist.get_world_size() if args.ring_size is None else args.ring_size,
            args.total,
            args.heads,
            args.kv_heads,
            args.head_dim,
            args.dtype,
            args.layout,
            args.comm,
            args.iters,
            not args.no_reference,
        )
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, res)
        if dist.get_rank() == 0:
            worst = {k: max(r[k] for r in every) for k in every[0] if k not in ("errors", "ok")}
            print(
                f"ring fwd+bwd {worst['ring_s'] * 1e3:.1f} ms (slowest rank), causal balance "
                f"max/mean {worst['balance']:.3f}"
            )
            if "single_s" in worst:
                print(f"single device {worst['single_s'] * 1e3:.1f} ms")
                for name in ("out", "dq", "dk", "dv"):
                    err, ref_err, tol = (max(r["errors"][name][i] for r in every) for i in range(3))
                    print(
                        f"  {name}: max abs error ring {err:.2e}, single device {ref_err:.2e} "
                        f"(vs {'fp64' if args.dtype == 'fp32' else 'fp32'}; tolerance {tol:.2e})"
                    )
                bad = [i for i, r in enumerate(every) if not r["ok"]]
                print(f"FAIL: ranks {bad} exceed the tolerance" if bad else "PASS")
        ok = all(r.get("ok", True) for r in every)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
