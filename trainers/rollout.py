"""Rollout generation behind a small interface, so the trainer does not care who generates.

:class:`GenerationEngine` is the protocol the PPO trainer calls; :class:`HFGenerationEngine` is
the portable implementation (transformers ``generate`` with the KV cache, any device, ZeRO-3
aware). A faster engine (e.g. vLLM on GPUs, with weights synced from the trainer) can implement
the same protocol and replace it without touching the trainer.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from rlhf_kernels._checks import is_int, is_real


@runtime_checkable
class GenerationEngine(Protocol):
    """Anything that turns token-id prompts into sampled token-id responses.

    ``generate`` returns ``len(prompts) * n_samples`` responses, prompt-major (all samples of
    prompt 0, then of prompt 1, ...), each a list of generated ids ending with a stop id (kept:
    the tokenizer's EOS, or an end-of-turn id the model stops on) when one was produced, else
    exactly ``max_new_tokens`` long; never padding, never the prompt.
    The same call with the same ``seed`` gives the same responses; different seeds differ.
    Implementations: :class:`HFGenerationEngine` (transformers), or e.g. a vLLM engine on GPUs.

    Optional attribute ``synced`` (False when absent): True when the ranks' calls are
    collectives (e.g. ZeRO-3 partitioned weights); every rank then makes the same calls in the
    same order, with the same ``n_samples`` (a rank with fewer prompts makes dummy calls).
    """

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
    ) -> list[list[int]]: ...


# generation_config fields that would reshape the policy's distribution (hub defaults such as
# top_k=50 or repetition_penalty), set to values that turn their logits processors off
_NEUTRAL = {
    "top_k": 0,
    "min_p": None,
    "top_h": None,
    "typical_p": None,
    "epsilon_cutoff": None,
    "eta_cutoff": None,
    "repetition_penalty": None,
    "no_repeat_ngram_size": None,
    "sequence_bias": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "min_length": 0,
    "min_new_tokens": None,
    "num_beams": 1,
    "renormalize_logits": False,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "encoder_repetition_penalty": None,  # (applied to decoder-only models too, on the prompt)
    "max_time": None,
    "stop_strings": None,
}
_GREEDY = {"temperature": None, "top_p": None, "top_k": None}


def _stop_set(eos: int | Sequence[int]) -> set[int]:
    return {eos} if isinstance(eos, numbers.Integral) else set(eos)


def cut_at_eos(tokens: list[int], eos: int | Sequence[int]) -> list[int]:
    """``tokens`` up to and including its first ``eos`` (one id or any of several ids; all of
    ``tokens`` when there is none)."""
    stops = _stop_set(eos)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return list(tokens)


def split_responses(
    sequences: torch.Tensor, prompt_width: int, eos_id: int | Sequence[int], pad_id: int | None
) -> list[list[int]]:
    """``generate``'s output ``(B, prompt_width + T)`` of left-padded prompts -> B responses.

    Drops the (padded) prompt columns, cuts each row after its first ``eos_id`` (kept; one id or
    several stop ids) and drops trailing ``pad_id`` (a row that finished early is padded up to
    the batch's length; when ``pad_id`` is a stop id the cut already removes them).
    """
    if sequences.dim() != 2 or not 0 <= prompt_width <= sequences.shape[1]:
        raise ValueError(
            f"split_responses: expected sequences (B, prompt_width + T) with prompt_width <= "
            f"{sequences.shape[-1] if sequences.dim() else 0}, got shape "
            f"{tuple(sequences.shape)} and prompt_width={prompt_width}"
        )
    stops = _stop_set(eos_id)
    out = []
    for row in sequences[:, prompt_width:].tolist():
        row = cut_at_eos(row, stops)
        if pad_id is not None and pad_id not in stops and not (row and row[-1] in stops):
            while row and row[-1] == pad_id:
                row.pop()
        out.append(row)
    return out


def _is_id(t) -> bool:
    return is_int(t) and t >= 0


def _check_args(prompts, n_samples, max_new_tokens, temperature, top_p, greedy, seed) -> None:
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError(
            f"generate: prompts: expected a non-empty list of token-id lists, got {prompts!r:.80}"
        )
    for i, p in enumerate(prompts):
        if not isinstance(p, Sequence) or len(p) == 0:
            raise ValueError(
                f"generate: prompts[{i}]: expected a non-empty list of token ids, got {p!r:.80}"
            )
        bad = [t for t in p if not _is_id(t)]  # (a float id would be truncated silently)
        if bad:
            raise ValueError(
                f"generate: prompts[{i}]: expected token ids (ints >= 0), got {bad[0]!r} in "
                f"{p!r:.80}"
            )
    if not is_int(seed):  # 1.5 would seed 1
        raise ValueError(f"generate: seed: expected an int, got {seed!r}")
    for name, v in (("n_samples", n_samples), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"generate: {name}: expected an int >= 1, got {v!r}")
    if not greedy and not is_real(temperature, finite=True, positive=True):
        raise ValueError(
            f"generate: temperature: expected a float > 0 when sampling (greedy=False), got "
            f"{temperature!r}"
        )
    if not (is_real(top_p) and 0 < top_p <= 1):  # (a bool, NaN fail)
        raise ValueError(f"generate: top_p: expected a float in (0, 1], got {top_p!r}")


class HFGenerationEngine:
    """transformers ``generate`` with the KV cache on left-padded batches of ``batch_size``.

    ``model`` is the raw HF causal LM (under DeepSpeed the wrapped module, e.g.
    ``engine.module.lm``). Each call runs in eval mode under ``torch.no_grad()`` (the previous
    mode is restored) with ``use_cache=True`` whatever ``config.use_cache`` says. It samples
    from the model's softmax shaped only by ``temperature`` and ``top_p``: ``top_k``, repetition
    penalties, ``min_p`` etc. from ``model.generation_config`` are switched off. The pad token is
    never generated (it is suppressed unless it is a stop id), so responses hold no padding.
    Generation stops at the tokenizer's EOS and at the ids of ``generation_config.eos_token_id``
    (e.g. ``<|eot_id|>`` or ``<end_of_turn>`` of chat models whose tokenizer EOS differs).

    Randomness: each call seeds a forked RNG with ``seed`` (the caller's CPU/accelerator RNG state
    is unchanged afterwards). Samples depend on the call's whole batch layout, so a caller that
    wants a prompt to get the same responses wherever it is generated (e.g. on any
    data-parallel rank) calls once per prompt with a per-prompt seed.

    ZeRO-3 (``zero3=True`` with more than one process): DeepSpeed gathers each layer's weights
    in every forward, a collective, so ranks must run forwards in lockstep. Each decoding step is
    synced over the world (transformers' ``synced_gpus``: a rank whose sequences ended keeps
    stepping until every rank's have), and ``synced`` is True: every rank must make the same
    ``generate`` calls (a rank with fewer prompts pads with dummy calls).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64, zero3: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"HFGenerationEngine: batch_size: expected an int >= 1, got {batch_size!r}"
            )
        if tokenizer.eos_token_id is None:
            raise ValueError("HFGenerationEngine: tokenizer: expected an eos_token_id, got None")
        self.model, self.tokenizer = model, tokenizer
        # stop ids: the tokenizer's EOS first, then the model's own (int or list) end ids
        extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        self.stop_ids = list(dict.fromkeys([int(tokenizer.eos_token_id), *map(int, extra)]))
        self.batch_size = batch_size
        self.synced = zero3 and dist.is_initialized() and dist.get_world_size() > 1

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
        """``len(prompts) * n_samples`` responses, prompt-major, each ending with EOS (kept) when
        produced, else exactly ``max_new_tokens`` long. ValueError on bad arguments."""
        _check_args(prompts, n_samples, max_new_tokens, temperature, top_p, greedy, seed)
        tok = self.tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        device = next(self.model.parameters()).device
        flat = [list(p) for p in prompts for _ in range(n_samples)]
        flags = dict(_NEUTRAL)  # a model's generation_config must not change the distribution
        if greedy:  # every sampling flag unset: transformers has nothing to warn about
            flags.update(do_sample=False, **_GREEDY)
        else:
            flags.update(do_sample=True, temperature=float(temperature), top_p=float(top_p))
        if pad not in self.stop_ids:  # a sampled pad could not be told from padding
            flags["suppress_tokens"] = [pad]
        out: list[list[int]] = []
        rng_devices = [] if device.type == "cpu" else [device]
        with torch.random.fork_rng(devices=rng_devices, device_type=device.type):
            torch.manual_seed(seed)
            for i in range(0, len(flat), self.batch_size):
                ids, mask = _left_pad(flat[i : i + self.batch_size], pad)
                seqs = self._run(ids, mask, max_new_tokens, flags)
                out += split_responses(seqs.cpu(), ids.shape[1], self.stop_ids, pad)
        return out

    @torch.no_grad()
    def _run(self, ids, mask, max_new_tokens: int, flags: dict) -> torch.Tensor:
        """One ``model.generate`` batch in eval mode (the mode is restored after)."""
        tok, device = self.tokenizer, next(self.model.parameters()).device
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        was_training = self.model.training
        self.model.eval()
        try:
            return self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                use_cache=True,
                # Hub Gemma-2 generation configs ask for "hybrid" (a static cache), which
                # rlhf_kernels attention refuses; the dynamic cache gives the same tokens
                cache_implementation="dynamic",
                pad_token_id=pad,
                eos_token_id=self.stop_ids,
                synced_gpus=self.synced,
                **flags,
            )
        finally:
            self.model.train(was_training)


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``(B, max_len)`` long, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p) :] = 1
    return ids, mask
