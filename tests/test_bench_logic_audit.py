"""Audit of the GPU benchmark scripts' logic on CPU: ``bench/gpu_check.py`` (FLOPs, ratios,
mismatch, budget, exit status, result files) and ``bench/attn_host.py`` (autotuning picks)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_check  # noqa: E402

FAKE = dict(gpu="NVIDIA Fake GPU", torch="t", cuda="c", triton="tr", python="p")


@pytest.fixture
def fake_gpu(monkeypatch):
    """gpu_check.main on a CPU machine: CUDA 'available', a fixed machine description."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    machine = dict(FAKE, rlhf_kernels_commit=None, native_ext=False, native_cuda_gae=False,
                   versions={"flash_attn": None, "liger_kernel": "0.8.5"})  # fmt: skip
    monkeypatch.setattr(gpu_check, "machine", lambda: machine)
    monkeypatch.delenv("GPU_CHECK_DEADLINE", raising=False)


def test_causal_flops_and_lengths():
    # useful causal FLOPs: 4 * l^2 / 2 per head and head dim, summed over documents
    assert gpu_check._causal_flops([3, 5], 2, 4) == 4 * (9 + 25) / 2 * 2 * 4
    for total, lo, hi in ((8192, 512, 2048), (100, 7, 30)):
        lens = gpu_check._lengths(total, lo, hi, seed=1)
        assert sum(lens) == total and all(lo <= x <= hi for x in lens[:-1]) and 0 < lens[-1] <= hi
    assert list(gpu_check._cumsum([2, 3, 4])) == [2, 5, 9]


def test_mismatch_threshold_is_two_percent():
    assert gpu_check.MISMATCH_REL == 0.02
    assert not gpu_check._mismatch([0.0, 0.0199]) and gpu_check._mismatch([0.0201, 0.0])
    assert not gpu_check._mismatch([])


@pytest.mark.parametrize(
    "row, fails",
    [
        (dict(error="RuntimeError()"), True),  # a whole part raised
        (dict(method="linear_nll_loss", error="OOM"), True),
        (dict(method="linear_logprobs", error="OOM"), True),
        (dict(method="ours_triton_autotuned", error="OOM"), True),
        (dict(method="gae_cuda", error="OOM"), True),
        (dict(method="naive_cross_entropy", error="OOM"), False),  # a peer's own failure
        (dict(method="liger_fused_linear_ce", error="OOM"), False),
        (dict(method="torch_varlen_flash", error="OOM"), False),
        (dict(method="torch_varlen_flash", mismatch=False), False),
        (dict(method="naive_logsoftmax_gather", mismatch=True), True),
        (dict(world=2, mismatch=True), True),  # a ring-tile row
    ],
)
def test_fails_says_which_rows_fail_the_check(row, fails):
    assert gpu_check._fails(row) is fails


def test_ring_row_ratios_and_tflops(monkeypatch):
    """The ring row's derived numbers from known timings: per-rank fwd+bwd = fwd + bwd, the
    slowest rank against single-device time / world, TFLOP/s of one rank's share (x3.5)."""
    times = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # fwd r0, r1; bwd r0, r1; single fwd, fwd+bwd
    monkeypatch.setattr(gpu_check, "_bench", lambda fn, quick=False: next(times))
    row = gpu_check.ring_block_work(64, 2, "cpu", heads=2, kv_heads=1, dim=16)
    assert row["rank_fwd_ms"] == [1.0, 2.0] and row["rank_fwd_bwd_ms"] == [4.0, 6.0]
    assert (row["single_fwd_ms"], row["single_fwd_bwd_ms"]) == (5.0, 6.0)
    assert row["fwd_vs_ideal"] == pytest.approx(2.0 / (5.0 / 2))
    assert row["fwd_bwd_vs_ideal"] == pytest.approx(6.0 / (6.0 / 2))
    lengths = gpu_check._lengths(64, 4, 16, seed=2)
    share = 2 * sum(n * n for n in lengths) * 2 * 16 / 2  # FLOPs per rank
    assert row["docs"] == len(lengths)
    assert row["fwd_tflops"] == pytest.approx(share / 2e-3 / 1e12)  # 2 ms slowest forward
    assert row["fwd_bwd_tflops"] == pytest.approx(3.5 * share / 6e-3 / 1e12)
    assert not row["mismatch"] and row["rel_err_out"] < 1e-5


def test_write_markdown_flags_mismatch_and_counts_tflops(tmp_path):
    att = dict(total=8192, dim=64, heads=32, docs=9, mix="uneven", fwd_ms=1.5, fwd_bwd_ms=4.0,
               fwd_tflops=123.4, fwd_bwd_tflops=87.6, reference="ours_triton",
               rel_err_out=0.001, rel_err_dq=0.002, mismatch=False)  # fmt: skip
    flex = dict(total=8192, dim=64, method="flex_doc_mask", error="OutOfMemoryError()")
    rows = [dict(att, method="ours_triton"), dict(att, method="flash_attn", mismatch=True), flex]
    report = dict(date="2026-01-02", machine=dict(FAKE, rlhf_kernels_commit="abc"),
                  attention=rows, parts=["attention"], unfinished=["gae"])  # fmt: skip
    path = tmp_path / "r.md"
    gpu_check.write_markdown(report, path)
    md = path.read_text()
    ours, flash = (ln for ln in md.splitlines() if ln.startswith("| 64 | 8192"))
    assert "| ours_triton | 1.500 | 123 | 4.000 | 88 |" in ours and "MISMATCH" not in ours
    assert "| flash_attn |" in flash and flash.rstrip(" |").endswith("MISMATCH")
    assert "## Failed" in md and "flex_doc_mask" in md.split("## Failed")[1]
    assert "Unfinished" in md and "gae" in md.split("Unfinished")[1]


def test_budget_stops_starting_rows_inside_a_part(fake_gpu, monkeypatch, tmp_path):
    """Past --budget-s no new row starts, in the middle of a part too; the part is unfinished,
    the next part does not start, and the exit status is 1."""
    started = []

    def slow(quick):
        for i in range(3):
            started.append(i)
            time.sleep(0.3 if i == 0 else 0.0)
            yield dict(method=f"linear_{i}", ms=1.0)

    def other(quick):
        started.append("other")
        yield dict(method="x", ms=1.0)

    monkeypatch.setattr(gpu_check, "PARTS", dict(linear=slow, gae=other))
    args = ["--only", "linear", "gae", "--budget-s", "0.2", "--out-dir", str(tmp_path)]
    assert gpu_check.main(args) == 1
    assert started == [0]
    (js,) = tmp_path.glob("gpu-check-fake-gpu-*.json")
    got = json.loads(js.read_text())
    assert got["unfinished"] == ["linear", "gae"] and len(got["linear"]) == 1
    assert "gae" not in got and got["budget_s"] == 0


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "soon"])
def test_bad_budget_is_a_usage_error_before_any_work(value, fake_gpu, monkeypatch, tmp_path):
    # inf and NaN used to raise from round() after the output folder was made
    monkeypatch.setattr(gpu_check, "PARTS", dict(gae=lambda quick: iter([dict(method="a")])))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--budget-s", value, "--out-dir", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert gpu_check.main(["--budget-s", "30", "--out-dir", str(out)]) == 0


@pytest.mark.parametrize("value", ["soon", "nan", "inf"])
def test_bad_deadline_is_a_usage_error_before_any_work(
    value, fake_gpu, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(gpu_check, "PARTS", dict(gae=lambda quick: iter([dict(method="a")])))
    monkeypatch.setenv("GPU_CHECK_DEADLINE", value)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out-dir", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert f"$GPU_CHECK_DEADLINE must be a Unix time in seconds, got {value!r}" in (
        capsys.readouterr().err
    )


def test_only_with_no_part_is_a_usage_error(fake_gpu, monkeypatch, tmp_path):
    # it used to measure nothing and exit 0: a passing check that checked nothing
    monkeypatch.setattr(gpu_check, "PARTS", dict(gae=lambda quick: iter([dict(method="a")])))
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--only", "--out-dir", str(tmp_path)])
    assert e.value.code == 2 and not list(tmp_path.iterdir())


def test_markdown_has_what_the_readme_promises(fake_gpu, monkeypatch, tmp_path):
    """bench/README.md: the files carry the peers' versions, whether the native extension (and
    its CUDA GAE) was built, and seconds per part; the .md used to have none of them."""
    monkeypatch.setattr(gpu_check, "PARTS", dict(gae=lambda quick: iter([dict(method="a")])))
    assert gpu_check.main(["--only", "gae", "--out-dir", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("gpu-check-fake-gpu-*.md")
    text = md.read_text()
    got = json.loads(md.with_suffix(".json").read_text())
    assert got["machine"]["native_ext"] is False and "gae" in got["part_s"]
    assert "Native extension False (CUDA GAE False)" in text
    assert '"liger_kernel": "0.8.5"' in text and '{"gae": ' in text
    assert got["started"] in text


def test_attn_host_picks_read_the_launch_cache(monkeypatch):
    """attn_host's autotuned rows record the blocks the launch cache kept for that pack size and
    head dim; the cache key grew a dtype and _picks raised TypeError on every autotuned row."""
    attn_host = pytest.importorskip("bench.attn_host")
    vt = attn_host.vt
    monkeypatch.setattr(vt, "_FITTING_BLOCKS", {})
    monkeypatch.setattr(vt, "_autotune_on", lambda device: True)
    monkeypatch.setattr(vt, "_tune", lambda kernel, make, meta, cands: cands[-1])

    class Kernel:  # a launched Triton kernel: kernel[grid](*args, **meta)
        def __init__(self, name):
            self.fn = SimpleNamespace(__name__=name)

        def __getitem__(self, grid):
            return lambda *args, **meta: None

    def launch(name, tokens, block_d):
        kernel = Kernel(name)
        meta = dict(GROUP=1, BLOCK_D=block_d)
        vt._launch(kernel, lambda bm, bn: ((1,), ()), meta, (64, 64, 4, 3), torch.device("cpu"),
                   backward=True, tokens=tokens, dtype=torch.bfloat16)  # fmt: skip

    launch("_bwd_dq_kernel", 8000, 64)  # pack size 8192
    launch("_bwd_dkdv_kernel", 8192, 64)
    launch("_bwd_dq_kernel", 32768, 64)  # another pack size
    launch("_fwd_kernel", 8192, 128)  # another head dim
    want = list(vt._candidates((64, 64, 4, 3), True)[-1])
    assert attn_host._picks(8192, 64) == {"_bwd_dq_kernel": want, "_bwd_dkdv_kernel": want}
    assert attn_host._picks(8192, 128) == {"_fwd_kernel": want}
    assert attn_host._picks(4096, 64) == {}


def test_gpu_check_out_dir_that_is_a_file_is_a_usage_error(fake_gpu, tmp_path):
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit) as e:  # it was a FileExistsError traceback
        gpu_check.main(["--only", "gae", "--out-dir", str(taken)])
    assert e.value.code == 2 and taken.read_text() == "not a folder"


def test_attn_host_checks_its_out_dir_before_the_timings(monkeypatch, tmp_path):
    """attn_host writes its file once, after every timing: a bad --out-dir used to be found
    only then, losing the run."""
    attn_host = pytest.importorskip("bench.attn_host")
    timed = []

    def rows(total, dim, calls, wanted):
        timed.append((total, dim))
        yield dict(total=total, dim=dim, method="kernel", error="skipped in this test")

    monkeypatch.setattr(attn_host, "_rows", rows)
    monkeypatch.setattr(attn_host.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attn_host.torch.cuda, "get_device_name", lambda *a: "NVIDIA Fake GPU")
    info = dict(versions={}, git_commit=None, git_dirty=False)
    monkeypatch.setattr(attn_host, "collect_machine_info", lambda: info)
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    args = ["--totals", "8192", "--dims", "64", "--methods", "kernel"]
    with pytest.raises(SystemExit) as e:
        attn_host.main([*args, "--out-dir", str(taken)])
    assert e.value.code == 2 and timed == []
    attn_host.main([*args, "--out-dir", str(tmp_path / "new")])
    (path,) = (tmp_path / "new").glob("attn-host-fake-gpu-*.json")
    assert timed == [(8192, 64)] and json.loads(path.read_text())["rows"][0]["dim"] == 64


@pytest.mark.parametrize("where", ["missing/sweep.json", "."])
def test_attn_sweep_checks_out_before_the_sweep(where, monkeypatch, tmp_path):
    from bench import attn_sweep, report

    monkeypatch.setattr(attn_sweep.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(report, "collect_machine_info", lambda: dict(gpu="fake"))
    with pytest.raises(SystemExit) as e:  # a FileNotFoundError / IsADirectoryError at the end
        attn_sweep.main(["--dims", "--out", str(tmp_path / where)])
    assert e.value.code == 2
    attn_sweep.main(["--dims", "--out", str(tmp_path / "sweep.json")])
    assert json.loads((tmp_path / "sweep.json").read_text())["machine"] == dict(gpu="fake")


def test_a_failed_write_keeps_the_previous_rows(fake_gpu, monkeypatch, tmp_path):
    """Both result files are rewritten after every row; a write that fails half-way (a full
    disk) must leave the previous version, not a truncated file (the .md was written in place)."""
    real = Path.write_text
    full = []

    def write_text(self, text, *args, **kwargs):
        if full and ".md" in self.name:  # opened (truncated), then the disk is full
            real(self, "")
            raise OSError(28, "No space left on device")
        return real(self, text, *args, **kwargs)

    def part(quick):
        yield dict(method="first", ms=1.0)
        full.append(True)
        yield dict(method="second", ms=2.0)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(gpu_check, "PARTS", dict(gae=part))
    with pytest.raises(OSError, match="No space"):
        gpu_check.main(["--only", "gae", "--out-dir", str(tmp_path)])
    (js,) = tmp_path.glob("gpu-check-fake-gpu-*.json")
    assert [r.get("method") for r in json.loads(js.read_text())["gae"]][:2] == ["first", "second"]
    md = js.with_suffix(".md").read_text()
    assert '"method": "first"' in md and '"method": "second"' not in md


class _TorchOnCpu:
    """``gpu_check``'s torch with ``device="cuda"`` tensors and generators made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def Generator(self, device=None):  # noqa: N802 (torch's name)
        return torch.Generator()

    def randn(self, *shape, device=None, **kwargs):
        return torch.randn(*shape, **kwargs)


def test_attention_rows_tflops_errors_and_env(monkeypatch):
    """One attention case with stand-in peers: TFLOP/s (x3.5 for fwd+bwd), the relative error
    against ours and the 2% mismatch flag, a peer's failure as an error row, the autotune
    environment set for that peer only."""
    seen_env = {}

    def peer(scale, name):
        def fn(q, k, v):
            seen_env[name] = gpu_check.os.environ.get("RLHF_KERNELS_AUTOTUNE")
            return (q.float() + k.float() - v.float()) * scale

        return fn

    def broken(q, k, v):
        raise RuntimeError("CUDA out of memory")

    def dq_off(q, k, v):  # ours' output, 5% more gradient
        out = peer(1.0, "dq_off")(q, k, v)
        return out + 0.05 * (out - out.detach())

    peers = dict(ours_triton=peer(1.0, "ours"), flex_doc_mask=broken, near=peer(1.01, "near"),
                 far=peer(1.05, "far"), dq_off=dq_off,
                 ours_triton_autotuned=peer(1.0, "auto"))  # fmt: skip
    monkeypatch.setattr(gpu_check, "torch", _TorchOnCpu())
    monkeypatch.setattr(gpu_check, "_attention_peers", lambda lengths, heads, dim: peers)

    def bench(fn, quick=False):  # a forward returns the output, a fwd+bwd step None
        return 2.0 if fn() is not None else 7.0

    monkeypatch.setattr(gpu_check, "_bench", bench)
    monkeypatch.delenv("RLHF_KERNELS_AUTOTUNE", raising=False)
    rows = {r["method"]: r for r in gpu_check._attention_case(64, 64, quick=True)}
    lengths = gpu_check._lengths(64, 4, 16, seed=64 + 64)
    flops = 4 * sum(n * n for n in lengths) / 2 * 32 * 64
    ours = rows["ours_triton"]
    assert (ours["heads"], ours["docs"], ours["mix"]) == (32, len(lengths), "uneven")
    assert ours["fwd_tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert ours["fwd_bwd_tflops"] == pytest.approx(3.5 * flops / 7e-3 / 1e12)
    assert ours["rel_err_out"] == 0 and not ours["mismatch"] and ours["reference"] == "ours_triton"
    # relative to ours' largest entry (dq: the bf16 leaves' gradients, rounded)
    assert rows["near"]["rel_err_out"] == pytest.approx(0.01, rel=1e-4)
    assert rows["near"]["rel_err_dq"] == pytest.approx(0.01, abs=2e-3)
    assert rows["far"]["reference"] == "ours_triton"
    assert not rows["near"]["mismatch"] and rows["far"]["mismatch"]
    assert rows["dq_off"]["rel_err_out"] == 0 and rows["dq_off"]["mismatch"]
    assert "out of memory" in rows["flex_doc_mask"]["error"] and not gpu_check._fails(
        rows["flex_doc_mask"]
    )
    assert seen_env == dict(ours=None, auto="1", near=None, far=None, dq_off=None)
    assert "RLHF_KERNELS_AUTOTUNE" not in gpu_check.os.environ


def test_make_gpu_check_caps_the_tests_by_the_time_left(tmp_path):
    # the tests' timeout was a flat GPU_TEST_SECONDS: a slow build pushed the target past
    # GPU_SECONDS. A fake python (slow build) and a `timeout` that records its duration.
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "fakepy").write_text('#!/bin/sh\n[ "$1" = setup.py ] && sleep 3\nexit 0\n')
    (bin_ / "timeout").write_text(f'#!/bin/sh\necho "$5" > {tmp_path}/tests_s\nexit 0\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}")
    args = [f"GPU_PY={bin_ / 'fakepy'}", f"GPU_OUT={tmp_path / 'out'}", "GPU_TEST_SECONDS=100"]
    subprocess.run(
        ["make", "-s", "gpu-check", "GPU_SECONDS=2", *args], cwd=ROOT, env=env, check=True
    )
    assert (tmp_path / "tests_s").read_text().split() == ["1"]
    subprocess.run(
        ["make", "-s", "gpu-check", "GPU_SECONDS=600", *args], cwd=ROOT, env=env, check=True
    )
    assert (tmp_path / "tests_s").read_text().split() == ["100"]
