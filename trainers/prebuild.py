"""``python -m trainers.prebuild``: compile DeepSpeed's CPU ops once (``make install`` runs it).

On a machine without CUDA, DeepSpeed's CPU accelerator JIT-builds its shared-memory collective op
at every first ``deepspeed.initialize`` and the CPU Adam op for ``--offload`` (a minute or more
each on two cores). Building them here, into ``$TORCH_EXTENSIONS_DIR``, moves that cost to
installation (``<sys.prefix>/torch_extensions``, where the trainers look). On CUDA machines this
does nothing.
"""

from __future__ import annotations

import os
import sys
import time


def use_prebuilt_ops() -> None:
    """Point DeepSpeed's JIT builds at ``<sys.prefix>/torch_extensions`` (the venv) unless the
    user chose a folder; on CPU select DeepSpeed's CPU accelerator."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    import torch

    if torch.cuda.is_available():
        return
    use_prebuilt_ops()
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        builder = acc.create_op_builder(name)
        if builder is None:
            continue
        t0 = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 - a missing compiler only disables the op
            print(
                f"DeepSpeed op {name} not built ({e}); it will be tried again at first use",
                file=sys.stderr,
            )
            continue
        print(
            f"DeepSpeed op {name} ready ({time.perf_counter() - t0:.0f} s, "
            f"{os.environ['TORCH_EXTENSIONS_DIR']})"
        )


if __name__ == "__main__":
    main()
