import os
import threading

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


@pytest.fixture
def _no_group():
    """No default process group before and after the test."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class _ThreadRing:
    """Collectives for ``world`` threads, each one a ring rank (``run`` starts them)."""

    def __init__(self, world):
        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world, timeout=20)
        self.local = threading.local()

    def group_rank(self, group=None):
        return self.local.rank, self.world

    def _exchange(self, t):
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every

    def all_gather_flat(self, out, inp, group=None):
        out.copy_(torch.cat(self._exchange(inp)))

    def all_reduce(self, t, group=None):
        t.copy_(torch.stack(self._exchange(t)).sum(0))

    def run(self, fn):
        """``fn(rank)`` on every rank; returns each rank's result or exception."""
        return run_on_threads(self.world, fn, lambda rank: setattr(self.local, "rank", rank))


def run_on_threads(world, fn, start=lambda rank: None):
    """``fn(rank)`` on ``world`` threads after ``start(rank)`` on each; every rank's result or
    exception, in rank order. Fails when a rank is still running after 30 s."""
    out = [None] * world

    def body(rank):
        start(rank)
        try:
            out[rank] = fn(rank)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


@pytest.fixture
def thread_ring(monkeypatch):
    """Two threads playing ring ranks: ``gather`` / ``validate``'s collectives between them."""
    import torch.distributed as dist

    from rlhf_kernels.ring import gather, validate

    fake = _ThreadRing(2)
    monkeypatch.setattr(gather, "group_rank", fake.group_rank)
    monkeypatch.setattr(validate, "all_gather_flat", fake.all_gather_flat)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    return fake
