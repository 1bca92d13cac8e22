"""Review audit of the kl-clamp / teardown / group-failure commits (228b221..9bde0c7).

- the process groups destroyed at the end of ``Session.finish``: DeepSpeed kept its cached clone
  of the world group, and a second trainer run in the same process failed in
  ``deepspeed.initialize`` (they are now destroyed at interpreter exit).
- ``linear_policy_loss(..., group=)``: an input that failed with another exception type than
  TypeError/ValueError (old_logp on another device than labels: a RuntimeError after the
  try; a non-tensor bias: an AttributeError) left the peers waiting in the token count.
- the failure flag went to the CPU when ``hidden`` was on the CPU: NCCL takes CUDA tensors only.
- ``--kl-clamp``'s help named the wrong direction of k3's overflow.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ops.linear_logprobs import linear_nll_loss, linear_policy_loss
from rlhf_kernels.ring.spawn import run_gloo


def test_second_run_in_one_process_after_a_finished_run(monkeypatch, _no_group):
    pytest.importorskip("deepspeed")
    from deepspeed.comm import init_distributed as ds_init
    from deepspeed.utils import groups

    from trainers.distributed import destroy_at_exit, init_distributed

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    init_distributed(1, 1)
    ds_init("gloo")  # as deepspeed.initialize does
    groups._clone_world_group()
    destroy_at_exit()  # Session.finish of the first run
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    init_distributed(1, 1)  # the second run
    ds_init("gloo")
    # a group destroyed at the first run's end failed here: "Group ... is not registered"
    assert groups._get_broadcast_src_rank() == 0


T, H, V = 6, 4, 7


def _one_bad(rank, world, which):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    lab = torch.randint(0, V, (T,), generator=g)
    old, adv = -torch.rand(T, generator=g), torch.randn(T, generator=g)
    bias = None
    if rank == 1 and which == "old_logp_device":
        old, adv = old.to("meta"), adv.to("meta")  # (a CPU old_logp beside CUDA hidden)
    if rank == 1 and which == "bias_not_tensor":
        bias = 0.5
    try:
        if which == "nll_bias":
            linear_nll_loss(h, w, lab, bias=0.5 if rank == 1 else None, group=dist.group.WORLD)
        else:
            linear_policy_loss(h, w, lab, old, adv, bias=bias, group=dist.group.WORLD)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.multiproc
@pytest.mark.parametrize("which", ["old_logp_device", "bias_not_tensor", "nll_bias"])
def test_any_bad_input_on_one_rank_raises_on_every_rank(which):
    errors = run_gloo(_one_bad, 2, which, timeout_s=30)  # before: rank 0 hit the timeout
    assert "other rank(s) of the group passed invalid input" in errors[0]
    assert errors[1] != "no error"


def test_policy_loss_old_logp_on_another_device_is_a_value_error():
    h, w = torch.randn(T, H), torch.randn(V, H)
    lab = torch.randint(0, V, (T,))
    with pytest.raises(ValueError, match="old_logp is on meta, labels on cpu"):
        linear_policy_loss(h, w, lab, torch.zeros(T, device="meta"), torch.zeros(T, device="meta"))


def test_failure_flag_goes_to_cuda_on_an_nccl_group(monkeypatch):
    from rlhf_kernels.ops import linear_logprobs as ll

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # the bad rank's hidden is on the CPU (its labels too, or not a tensor at all)
    assert ll._flag_device(object(), torch.zeros(2, 3), [1, 2]) == torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert ll._flag_device(object(), [1.0], torch.zeros(2)) == torch.device("cpu")


def test_kl_clamp_help_names_the_direction_that_overflows():
    from rlhf_kernels.ops.losses import kl_penalty
    from trainers.cli import build_parser
    from trainers.ppo import PPOConfig

    # the actor gives the token e^-100 of the reference's probability: k3 = e^100 overflows
    assert math.isinf(kl_penalty(torch.tensor([-120.0]), torch.tensor([-20.0]), "k3").item())
    # the reference gives it e^-100 of the actor's: k3 = 99, finite
    assert kl_penalty(torch.tensor([-20.0]), torch.tensor([-120.0]), "k3").item() == 99.0
    (action,) = [a for a in build_parser(PPOConfig)._actions if "--kl-clamp" in a.option_strings]
    assert "where the actor gives a sampled token e^-88 of the reference's" in action.help
