import os

import torch

# Triton kernels run under the interpreter only where there is no GPU (it must be set before
# triton is imported). With CUDA the compiled kernels run; RLHF_KERNELS_INTERPRET=1 forces the
# interpreter anyway (to run the CPU suite on a GPU machine).
if not torch.cuda.is_available() or os.environ.get("RLHF_KERNELS_INTERPRET") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            # CPU-tensor Triton tests need the interpreter, which is off where CUDA is present
            skip = pytest.mark.skip(reason="Triton on CPU tensors: set RLHF_KERNELS_INTERPRET=1")
            for item in items:
                if "gpu" not in item.keywords and "triton" in item.nodeid.lower():
                    item.add_marker(skip)
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _keep_launcher_env():
    """torchrun's variables as they were before the test: ``init_distributed`` run in-process
    sets them, and a leftover ``RANK`` / ``MASTER_PORT`` sent later tests' plain ``python -m``
    runs to a stale port (EADDRINUSE)."""
    saved = {k: os.environ.get(k) for k in _LAUNCHER_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
