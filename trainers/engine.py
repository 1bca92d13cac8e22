"""DeepSpeed for the trainers: one config, one engine, full weights back out.

Optimizer steps take a variable number of micro-batches (token-budget planning), so the
DeepSpeed config says one micro-batch per step (``gradient_accumulation_steps = 1``) and the
trainer marks the accumulation boundary itself (``accumulate``): gradients of all micro-batches
of a step are summed, DeepSpeed averages them over its data-parallel group, and the trainer
scales each micro-batch loss so that the result is the gradient of the global token mean.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from pathlib import Path

import torch

from trainers.checkpoint import commit_folder
from trainers.distributed import Layout


def clips_itself(cfg, layout: Layout) -> bool:
    """Whether the trainer clips gradients itself instead of DeepSpeed: bf16 at ZeRO 0 with
    AutoTP, where DeepSpeed 0.19.8's bf16 optimizer counts only TP rank 0's shards in the norm
    (it tests the gradient tensors, not the parameters, for tensor-parallel marks)."""
    return cfg.zero_stage == 0 and cfg.dtype == "bf16" and layout.tp > 1


def ds_config(cfg, layout: Layout) -> dict:
    """The DeepSpeed JSON config of a run (ZeRO stage, offload, AutoTP, dtype, clipping)."""
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        # the trainer decides the real batch: these only satisfy DeepSpeed's batch arithmetic
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": layout.world,  # DeepSpeed counts every rank, TP ranks included
        "gradient_clipping": 0.0 if clips_itself(cfg, layout) else cfg.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if layout.tp > 1:
        config["tensor_parallel"] = {"autotp_size": layout.tp}
    return config


def lr_lambda(cfg, total_steps: int):
    """Linear warm-up, then constant or cosine decay toward 10%, reached at ``total_steps``
    (after the last update, which runs at the factor of ``total_steps - 1``)."""

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_engine(
    module: torch.nn.Module,
    cfg,
    layout: Layout,
    total_steps: int,
    lr: float | None = None,
    check_tp_inputs: bool = True,
):
    """``deepspeed.initialize`` with AdamW (``lr``, default ``cfg.lr``) and the warm-up/cosine
    schedule. With AutoTP, DeepSpeed compares the first forward's arguments across the tensor-
    parallel group; ``check_tp_inputs=False`` skips that for modules whose arguments are not
    plain tensors (PPO passes its samples and the per-rank ``Layout``)."""
    import deepspeed

    lr = cfg.lr if lr is None else lr
    if cfg.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(
            [p for p in module.parameters() if p.requires_grad],
            lr=lr,
            weight_decay=cfg.weight_decay,
            adamw_mode=True,
        )
    else:
        opt = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=lr,
            weight_decay=cfg.weight_decay,
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=opt, lr_scheduler=sched, config=ds_config(cfg, layout)
    )
    _undo_init_step(engine)
    engine.rk_cpu_adam = opt if cfg.offload else None  # see resync_cpu_adam
    if not check_tp_inputs and getattr(engine, "first_dataloader_check", None) is not None:
        engine.first_dataloader_check.remove()  # AutoTP's pickle-and-compare of the 1st forward
        engine.first_dataloader_check = None
    engine.rk_max_grad_norm = cfg.max_grad_norm if clips_itself(cfg, layout) else None
    return engine


def resync_cpu_adam(engine) -> None:
    """After a resume: bring DeepSpeedCPUAdam's C++ bias-correction powers to where the
    uninterrupted run has them. The C++ optimizer keeps ``beta^t`` as a running float product
    (``beta_t *= beta`` each step) but a fresh one, given the loaded step ``k + 1``, computes
    ``pow(beta, k + 1)`` instead, which differs in the last bit for many ``k`` (0.999: k + 1 = 3,
    6, 19..; 0.9: 9, 12, ...), so resumed updates were off by ~1e-7. Replaying steps 1..k on
    empty tensors rebuilds the same running product (no parameter is touched)."""
    opt = getattr(engine, "rk_cpu_adam", None)
    if opt is None:
        return
    steps = [int(s["step"]) for s in opt.state.values() if isinstance(s, dict) and "step" in s]
    if not steps:
        return
    group = opt.param_groups[0]
    beta1, beta2 = group["betas"]
    hp = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group["bias_correction"])
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, max(steps) + 1):
        opt.ds_opt_adam.adam_update(opt.opt_id, step, *hp, empty, empty, empty, empty)


def _undo_init_step(engine) -> None:
    """DeepSpeed 0.19.8 wraps a bf16 model's optimizer at ZeRO 0 in ``FP16_UnfusedOptimizer``,
    which takes one optimizer step on zero gradients when built: AdamW's step count starts at 1
    (the first real update is ~0.74 lr) and weight decay shrinks the fp32 master weights once.
    Undo it (fresh optimizer state, master weights = the model's), so ZeRO 0 steps as 1-3 do."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if not isinstance(opt, FP16_UnfusedOptimizer):
        return
    opt.optimizer.state.clear()
    with torch.no_grad():
        for low, high in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
            for p, master in zip(low, high, strict=True):
                master.copy_(p.float())


@contextlib.contextmanager
def checkpointing(module: torch.nn.Module):
    """Gradient checkpointing for a model kept in eval mode (dropout off, as PPO's actor and
    critic are). transformers checkpoints a layer only while it is in training mode, so inside
    this block the checkpointed layers alone are flagged as training (their submodules, dropout
    and attention, stay in eval mode); outside it, generation keeps its KV cache."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [
        m
        for m in module.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
    modes = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, mode in zip(layers, modes):
            m.training = mode


def build_frozen(module: torch.nn.Module, cfg, layout: Layout) -> torch.nn.Module:
    """A model that only runs forward (PPO's reference and reward models): eval mode, no grad.

    ``cfg.ref_zero_stage`` 0: a full copy on this rank's device. 3: DeepSpeed ZeRO-3 without an
    optimizer, weights partitioned over the ranks and gathered layer by layer in forward (every
    rank must run the same number of forwards, as for the trained engine); with
    ``cfg.ref_offload`` the partitions live on the CPU between uses. Returns the module to call.
    """
    module.eval().requires_grad_(False)
    if cfg.ref_zero_stage == 0:
        return module.to(layout.device)
    import deepspeed

    zero: dict = {"stage": 3}
    if cfg.ref_offload:
        zero["offload_param"] = {"device": "cpu"}
    config = {**ds_config(cfg, layout), "zero_optimization": zero}  # --tp-size 1 (validated)
    # the model's own dtype: an fp32 reward model stays fp32 under --dtype bf16, as at stage 0
    config["bf16"] = {"enabled": next(module.parameters()).dtype == torch.bfloat16}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config)
    engine.eval()
    return engine.module


def accumulate(engine, loss: torch.Tensor, last: bool) -> None:
    """Backward of one micro-batch; ``last`` marks the step's accumulation boundary."""
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss, scale_wrt_gas=False)


def optimizer_step(engine, layout: Layout) -> float:
    """``engine.step()``; returns the global gradient norm before clipping.

    ZeRO 1-3 optimizers report it; at ZeRO 0 it is computed here from the (data-parallel
    averaged) gradients: tensor-parallel shards summed over the TP group, replicated weights
    counted once. Where :func:`clips_itself`, the gradients are clipped here by that norm.
    """
    norm = None
    if engine.zero_optimization_stage() == 0:
        from deepspeed.runtime.utils import is_model_parallel_parameter

        grads = [
            p.grad
            for p in engine.module.parameters()
            if p.grad is not None and (layout.tp_rank == 0 or is_model_parallel_parameter(p))
        ]
        sq = torch.zeros((), dtype=torch.float64, device=layout.device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        if layout.tp > 1:
            from deepspeed.utils import groups

            torch.distributed.all_reduce(sq, group=groups.get_tensor_model_parallel_group())
        # a bf16 optimizer's gradients carry its loss scale (1 unless fp16-style scaling is on)
        scale = float(getattr(getattr(engine.optimizer, "loss_scale_config", None), "cur_scale", 1))
        norm = sq.sqrt().item() / scale
        max_norm = getattr(engine, "rk_max_grad_norm", None)
        if max_norm and norm > max_norm:  # every parameter, replicated ones on every TP rank
            coef = max_norm / (norm + 1e-6)
            for p in engine.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    engine.step()
    return norm if norm is not None else float(engine.get_global_grad_norm())


def full_state_dict(engine, layout: Layout) -> dict[str, torch.Tensor] | None:
    """The unsharded weights of ``engine.module`` on rank 0 (None elsewhere). Collective.

    One module at a time, ZeRO-3 partitions are gathered (``zero.GatheredParameters``) and
    AutoTP shards are gathered over the tensor-parallel group (``GatherReplacedLayerParams``;
    ``engine.save_16bit_model`` alone would write one TP shard). Non-persistent buffers (rotary
    tables) are left out, as in ``module.state_dict()``.
    """
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    sd: dict[str, torch.Tensor] = {}

    def visit(module: torch.nn.Module, prefix: str) -> None:
        params = list(module.parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                with GatherReplacedLayerParams(params, module, enabled=layout.tp > 1):
                    if layout.is_main:
                        for name, p in module.named_parameters(recurse=False):
                            sd[prefix + name] = p.detach().cpu().clone()
        if layout.is_main:
            for name, b in module.named_buffers(recurse=False):
                if b is not None and name not in module._non_persistent_buffers_set:
                    sd[prefix + name] = b.detach().cpu().clone()
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.")

    visit(engine.module, "")
    return sd if layout.is_main else None


def save_hf_model(
    model,
    tokenizer,
    state_dict: dict,
    path: str | os.PathLike,
    prefix: str,
    extra_config: dict | None = None,
) -> Path:
    """Rank 0: ``save_pretrained`` of the wrapped HF model from a gathered state dict, atomically
    and durably (written and flushed next to ``path``, then renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    for key, value in (extra_config or {}).items():
        setattr(model.config, key, value)
    model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    commit_folder(tmp, path)  # an earlier export stays whole until the new one is in place
    return path
