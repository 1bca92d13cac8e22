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
