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
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
