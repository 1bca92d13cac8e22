"""Rollout generation behind a small interface, so a faster engine (vLLM on GPUs) can replace
transformers' ``generate`` without touching the trainer."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch


class GenerationEngine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n_samples: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        seed: int = 0,
    ) -> list[list[int]]:
        """``len(prompts) * n_samples`` responses, prompt-major, each ending with EOS (kept)
        or exactly ``max_new_tokens`` long; never padding. Same ``seed``, same responses."""
        ...


def cut_at_eos(tokens: list[int], eos: int) -> list[int]:
    """A response up to and including its first EOS."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


class HFGenerationEngine:
    """transformers ``generate`` with the KV cache on left-padded batches.

    ``model`` is the raw HF causal LM (for a DeepSpeed engine, the wrapped module). Under ZeRO-3
    (``gather_zero3``) wrap calls in ``with engine.gathered():``, entered the same number of
    times on every data-parallel rank (it is a collective). Sampling is seeded per
    call with a forked RNG, so the caller's RNG state is unchanged.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64, gather_zero3: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.gather_zero3 = batch_size, gather_zero3

    def gathered(self):
        """Context that gathers ZeRO-3 partitions (with ``gather_zero3``), else nothing."""
        if not self.gather_zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()))

    def generate(
        self,
        prompts,
        *,
        n_samples,
        max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        greedy=False,
        seed=0,
    ):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if n_samples < 1 or max_new_tokens < 1:
            raise ValueError(
                f"n_samples and max_new_tokens must be >= 1, got {n_samples} and {max_new_tokens}"
            )
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        tok = self.tokenizer
        pad, eos = tok.pad_token_id, tok.eos_token_id
        device = next(self.model.parameters()).device
        flat = [p for p in prompts for _ in range(n_samples)]
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
        was_training = self.model.training
        self.model.eval()
        out: list[list[int]] = []
        try:
            with (
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
                torch.no_grad(),
            ):
                torch.manual_seed(seed)
                for i in range(0, len(flat), self.batch_size):
                    chunk = flat[i : i + self.batch_size]
                    width = max(len(p) for p in chunk)
                    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                    mask = torch.zeros_like(ids)
                    for b, p in enumerate(chunk):  # left padding
                        ids[b, width - len(p) :] = torch.tensor(p)
                        mask[b, width - len(p) :] = 1
                    gen = self.model.generate(
                        input_ids=ids.to(device),
                        attention_mask=mask.to(device),
                        max_new_tokens=max_new_tokens,
                        do_sample=not greedy,
                        use_cache=True,
                        pad_token_id=pad,
                        eos_token_id=eos,
                        **sampling,
                    )
                    for row in gen[:, width:].tolist():
                        out.append(cut_at_eos(row, eos))
        finally:
            self.model.train(was_training)
        return out
