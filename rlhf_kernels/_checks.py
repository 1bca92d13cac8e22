"""Input checks shared by the ops: raise early, name the argument, say expected vs given."""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref

import torch

# id(tensor) -> (weakref, version counter, data pointer, validated list), for tensors off the CPU:
# every layer of a model checks the same cu_seqlens tensor, and the cache turns all but the first
# check into a dict hit instead of a device -> host copy (a sync). A CPU tensor is read every
# time (tens of microseconds), so no write can leave a stale list there.
_VALIDATED: dict[int, tuple[weakref.ref, int, int, list[int]]] = {}
_CACHE_SIZE = 64


def _cached(t: torch.Tensor) -> list[int] | None:
    hit = _VALIDATED.get(id(t))
    if hit is None or hit[0]() is not t or hit[2] != t.data_ptr():
        return None
    try:
        return hit[3] if hit[1] == t._version else None
    except RuntimeError:  # inference tensors have no version counter
        return None


def _read_every_time(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def remember_validated(t: torch.Tensor, cu: list[int]) -> None:
    """Record ``t`` (holding the valid ``cu``) as checked, for tensors built valid by construction:
    a later check on the device takes ``cu`` instead of reading ``t`` back."""
    if _read_every_time(t):
        return
    try:
        version = t._version
    except RuntimeError:
        return
    if len(_VALIDATED) >= _CACHE_SIZE:
        _VALIDATED.clear()
    _VALIDATED[id(t)] = (weakref.ref(t), version, t.data_ptr(), cu)


def forget_validated(*tensors: torch.Tensor | None) -> None:
    """Drop cached validations, so the next check reads these tensors again."""
    for t in tensors:
        if t is not None:
            _VALIDATED.pop(id(t), None)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """Validate a ``cu_seqlens`` tensor against a packed length and return it as a Python list.

    Invariants: 1-D integer tensor, ``cu_seqlens[0] == 0``, non-decreasing,
    ``cu_seqlens[-1] == total``. The check reads the values (one small host copy). A tensor on
    a device (CUDA), already validated and not modified since, is not read again: "modified" as
    seen by its version counter, which writes that bypass torch's in-place ops do not bump
    (``dist.broadcast`` into the same tensor, NumPy or DLPack aliases, ``.data``). Pass a new
    tensor after such a write. CPU tensors are always read.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"{name} must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    cu = _cached(cu_seqlens)
    if cu is not None:
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] must equal the packed length {total}, got {cu[-1]}")
        return cu
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}]={cu[i]} < "
                f"{name}[{i - 1}]={cu[i - 1]}"
            )
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] must equal the packed length {total}, got {cu[-1]}")
    remember_validated(cu_seqlens, cu)
    return cu


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``(total,)``: the sequence index of every packed token, after
    :func:`check_cu_seqlens` (empty sequences own no token)."""
    cu = check_cu_seqlens(cu_seqlens, total)
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    lens = torch.tensor(lens, dtype=torch.long, device=cu_seqlens.device)
    seq = torch.arange(len(lens), device=cu_seqlens.device)
    return torch.repeat_interleave(seq, lens, output_size=total)


def is_real(x, *, finite: bool = False, positive: bool = False) -> bool:
    """A real Python/NumPy number (not a bool, not a tensor), optionally finite and/or > 0."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    return (not finite or math.isfinite(x)) and (not positive or x > 0)


def check_triton_device(name: str, t: torch.Tensor) -> None:
    """ValueError unless a Triton kernel can run on ``t``: a CUDA tensor, or any under the
    interpreter (``TRITON_INTERPRET=1`` before triton is imported). Launching on CPU tensors
    otherwise fails inside Triton with "0 active drivers"."""
    if t.is_cuda:
        return
    try:
        import triton
    except ImportError:
        msg = "backend='triton' needs the triton package, which is not installed"
        raise ValueError(msg) from None
    if not triton.knobs.runtime.interpret:
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            f"imported), got {name} on {t.device}"
        )


def is_int(x) -> bool:
    """A Python/NumPy integer, not a bool (``True`` is no count, index or id)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_scalar(x) -> bool:
    """A real number (:func:`is_real`) or a 0-d real tensor (options users pass as tensors)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_complex() and x.dtype != torch.bool
    return is_real(x)


def all_finite(*tensors: torch.Tensor) -> bool:
    """No NaN/inf in any of ``tensors`` (one host read each: meant for CPU tensors). The fused
    CPU attention kernel writes 0 for a row with NaN scores; callers skip it when this fails."""
    return all(bool(t.isfinite().all()) for t in tensors)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        given = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on the same device, got {given}")


def device_guard(t: torch.Tensor):
    """Context for a kernel launch on ``t``'s device: Triton launches on the *current* CUDA
    device, so a tensor on another GPU would fault without this."""
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def as_cu_seqlens(cu_seqlens, device: torch.device, name: str = "cu_seqlens"):
    """``cu_seqlens`` as given, or a list/tuple of ints converted to an int32 tensor on ``device``.

    None passes through; anything else that is not a tensor is a TypeError naming ``name``."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
            bad = [
                f"{type(x).__name__} {x!r}"
                for x in cu_seqlens
                if isinstance(x, bool) or not isinstance(x, int)
            ][:3]
            raise TypeError(f"{name} as a list/tuple must hold Python ints, got {bad}")
        return torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    raise TypeError(
        f"{name} must be an int32/int64 tensor or a list of ints, got {type(cu_seqlens).__name__}"
    )


def check_mask(mask: torch.Tensor | None, name: str = "mask") -> torch.Tensor | None:
    """ValueError unless every value of a numeric ``mask`` is 0 or 1 (bool masks pass); returns
    the mask to use.

    A mask of 2 would silently act as a weight. The check reads the mask (a host sync). While
    torch.compile traces, a data-dependent branch would break the graph, so the check runs at run
    time inside the ``rlhf_kernels::checked_mask`` op, whose output (a copy of the mask) the
    caller must use in place of ``mask`` for the check to stay in the graph."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if torch.compiler.is_compiling():
        from rlhf_kernels.ops.compiled import checked_mask

        return checked_mask(mask, name)
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or real numeric, got {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        vals = mask[bad].unique()[:5].tolist()
        raise ValueError(
            f"{name} values must be 0 or 1 (a token counts or not), got {int(bad.sum())} "
            f"other value(s): {vals}; pass weights separately, not in the mask"
        )
    return mask
