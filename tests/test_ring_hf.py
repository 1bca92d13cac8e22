"""A transformers Llama on a ring group: local losses add up to the single-process packed loss,
and the ring-summed gradients equal the single-process gradients."""

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ops.linear_logprobs import linear_nll_loss
from rlhf_kernels.ring.gather import ring_token_mean
from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.spawn import run_gloo

pytest.importorskip("transformers")

LENGTHS = [23, 1, 40, 2, 17]  # uneven, a length-1 document, one shorter than the ring
VOCAB = 61


def _model(ring_only=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_kernels.integrations.hf import register, register_ring

    name = register_ring() if ring_only else register()
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.0,
        initializer_range=0.3,  # large weights, so attention mistakes show in the loss
    )
    cfg._attn_implementation = name
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _batch():
    from rlhf_kernels.integrations.hf import packed_model_inputs

    g = torch.Generator().manual_seed(7)
    samples = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    labels = [s.clone() for s in samples]
    labels[2][:11] = -100  # a prompt without loss
    return packed_model_inputs(samples, labels)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _grad_err(model, ref_grads):
    """Max over parameters of |ring-summed grad - reference| / max|reference|."""
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        scale = ref_grads[name].abs().max().item() + 1e-6
        worst = max(worst, (g - ref_grads[name]).abs().max().item() / scale)
    return worst


def _worker(rank, world, configs):
    return {cfg: _compare(rank, world, *cfg) for cfg in configs}


def _compare(rank, world, layout, comm):
    from rlhf_kernels.integrations.hf import ring_context

    batch = _batch()
    # single-process packed forward/backward (the reference), same weights on every rank
    model = _model()
    ref_loss = model(**batch).loss
    ref_loss.backward()
    ref_grads = _grads(model)
    model.zero_grad()

    # ring: this rank's tokens only; labels shifted on the whole stream, then sharded
    cu = batch["cu_seq_lens_q"]
    plan = RingPlan.build(cu, world, layout)
    ids = batch["input_ids"][0]
    shift = plan.next_token_labels(batch["labels"][0], rank)
    with ring_context(plan, comm=comm):
        logits = model(
            input_ids=plan.shard(ids, rank)[None], position_ids=plan.position_ids(rank)[None]
        ).logits[0]
    token_loss = torch.nn.functional.cross_entropy(
        logits.float(), shift.clamp(min=0), reduction="none"
    )
    loss = ring_token_mean(token_loss, shift != -100)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    err = {"loss": abs(total.item() - ref_loss.item())}
    err["grad_rel"] = _grad_err(model, ref_grads)

    # the same through transformers' own loss (shift_labels + the ring-wide item count):
    # loss and ring-summed gradients
    model.zero_grad()
    n_items = torch.tensor(float((shift != -100).sum()))
    dist.all_reduce(n_items)
    with ring_context(plan, comm=comm):
        hf_loss = model(
            input_ids=plan.shard(ids, rank)[None],
            position_ids=plan.position_ids(rank)[None],
            labels=shift[None],
            shift_labels=shift[None],
            num_items_in_batch=n_items,
        ).loss
    hf_loss.backward()
    hf_total = hf_loss.detach().clone()
    dist.all_reduce(hf_total)
    err["hf_loss"] = abs(hf_total.item() - ref_loss.item())
    err["hf_grad_rel"] = _grad_err(model, ref_grads)

    # one call: the fused loss on the hidden states with group= (ring-wide token count)
    model.zero_grad()
    with ring_context(plan, comm=comm):
        hidden = model.model(
            input_ids=plan.shard(ids, rank)[None], position_ids=plan.position_ids(rank)[None]
        ).last_hidden_state[0]
    fused = linear_nll_loss(hidden, model.lm_head.weight, shift, group=dist.group.WORLD)
    fused.backward()
    fused_total = fused.detach().clone()
    dist.all_reduce(fused_total)
    err["fused_loss"] = abs(fused_total.item() - ref_loss.item())
    err["fused_grad_rel"] = _grad_err(model, ref_grads)

    # a ring-only model refuses a sharded forward outside ring_context, runs inside it
    ring_model = _model(ring_only=True)
    shard = dict(input_ids=plan.shard(ids, rank)[None], position_ids=plan.position_ids(rank)[None])
    try:
        ring_model(**shard)
        err["outside_ctx"] = None
    except RuntimeError as e:
        err["outside_ctx"] = str(e)
    with ring_context(plan, comm=comm):
        err["ring_only"] = (ring_model(**shard).logits[0] - logits).abs().max().item()
    return err


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_llama_ring_matches_single_process(world):
    configs = [("zigzag", "p2p"), ("contiguous", "allgather")]
    for rank, per_cfg in enumerate(run_gloo(_worker, world, configs, timeout_s=240)):
        assert set(per_cfg) == set(configs)
        for cfg, err in per_cfg.items():
            print(world, rank, cfg, err)
            assert err["loss"] < 1e-5, (rank, cfg, err)
            assert err["hf_loss"] < 1e-5, (rank, cfg, err)
            assert err["grad_rel"] < 1e-4, (rank, cfg, err)
            assert err["hf_grad_rel"] < 1e-4, (rank, cfg, err)
            assert err["fused_loss"] < 1e-5, (rank, cfg, err)
            assert err["fused_grad_rel"] < 1e-4, (rank, cfg, err)
            assert "only inside `with ring_context" in (err["outside_ctx"] or ""), err
            assert err["ring_only"] < 1e-6, (rank, cfg, err)


def _checkpointed_worker(rank, world):
    """Gradient checkpointing with the backward on another thread, as autograd runs CUDA
    backward on its device threads (which see none of the caller's ContextVars): the
    recomputed layers must still run ring attention."""
    import threading

    from rlhf_kernels.integrations.hf import ring_context

    batch = _batch()
    model = _model()
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    model.lm_head(hidden.last_hidden_state).float().square().mean().backward()
    ref_grads = _grads(model)
    model.zero_grad()

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints layers in training mode (no dropout configured)
    plan = RingPlan.build(batch["cu_seq_lens_q"], world, "zigzag")
    ids = batch["input_ids"][0]
    errors = []
    with ring_context(plan):
        out = model.model(
            input_ids=plan.shard(ids, rank)[None], position_ids=plan.position_ids(rank)[None]
        ).last_hidden_state
        real = plan.valid_mask(rank)[None, :, None]  # the shard's padding adds no loss
        loss = (model.lm_head(out).float().square() * real).sum() / (ids.numel() * VOCAB)

        def backward():
            try:
                loss.backward()
            except Exception as e:  # re-raised below, in the test's thread
                errors.append(e)

        thread = threading.Thread(target=backward)  # a fresh thread: no ContextVar of ours
        thread.start()
        thread.join()
    if errors:
        raise errors[0]
    return _grad_err(model, ref_grads)


@pytest.mark.multiproc
def test_checkpointed_layers_recompute_ring_attention_on_other_threads():
    for rank, err in enumerate(run_gloo(_checkpointed_worker, 2, timeout_s=240)):
        assert err < 1e-4, (rank, err)
