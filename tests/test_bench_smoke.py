"""Cheap checks of the benchmark code: report.py on a fake pytest-benchmark JSON, and the
attention benchmark's peers on a tiny packed batch (no timing)."""

from __future__ import annotations

import ast
import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_attention as ba  # noqa: E402
from bench import report  # noqa: E402
from bench.conftest import is_quick  # noqa: E402


def _fake_raw(stamped: bool) -> dict:
    def bench(group, name, median, extra):
        return {
            "group": group,
            "name": name,
            "fullname": f"bench/bench_x.py::{name}",
            "params": {"n": 3},
            "param": "3",
            "extra_info": extra,
            "options": {},
            "stats": {
                "min": median / 2,
                "max": median * 2,
                "mean": median * 1.1,
                "stddev": median / 10,
                "rounds": 5,
                "median": median,
                "iterations": 1,
            },
        }

    machine = {"python_version": "3.11.2", "cpu": {"brand_raw": "Fake CPU"}}
    if stamped:
        machine.update(
            cpu_model="Fake CPU",
            cpu_cores=2,
            torch_threads=2,
            gpu="NVIDIA H100 80GB HBM3",
            gpu_count=1,
            versions={"torch": "9.9", "rlhf_kernels": "0.1.0"},
            git_commit="abc123",
            git_dirty=False,
            bench_quick=True,
        )
    return {
        "machine_info": machine,
        "commit_info": {"id": "fromcommitinfo", "dirty": True},
        "benchmarks": [
            bench("g-one", "test_a[3]", 2e-3, {"label": "alpha", "tokens": 10}),
            bench("g-one", "test_b[3]", 4e-3, {}),
            bench("g/two", "test_c[3]", 1.5, {"bytes": 7}),
            bench(None, "test_d", 1e-6, {}),
        ],
        "datetime": "2026-01-02T03:04:05.000000+00:00",
        "version": "5.3.1",
    }


def test_report_groups_stats_and_machine():
    reps = report.build_reports(_fake_raw(stamped=True))
    assert sorted(reps) == ["g-one", "g/two", "ungrouped"]
    one = reps["g-one"]
    assert one["date"] == "2026-01-02"
    assert one["machine"]["tag"] == "h100-80gb-hbm3"
    assert one["machine"]["cpu_model"] == "Fake CPU" and one["machine"]["cpu_cores"] == 2
    assert one["versions"]["torch"] == "9.9"
    assert one["rlhf_kernels"] == {"version": "0.1.0", "git_commit": "abc123", "git_dirty": False}
    assert one["bench_quick"] is True
    a, b = one["benchmarks"]
    assert (a["name"], a["median"], a["rounds"], a["params"]) == ("test_a[3]", 2e-3, 5, {"n": 3})
    assert a["mean"] == pytest.approx(2.2e-3) and a["stddev"] == pytest.approx(2e-4)
    assert a["extra_info"] == {"label": "alpha", "tokens": 10} and b["extra_info"] == {}
    assert reps["g/two"]["benchmarks"][0]["extra_info"] == {"bytes": 7}


def test_report_unstamped_uses_only_the_raw_json():
    # raw JSON from elsewhere (no conftest stamp): never labelled with this machine's details
    rep = report.build_reports(_fake_raw(stamped=False), date="2030-05-06")["g-one"]
    assert rep["date"] == "2030-05-06"
    assert rep["machine"]["tag"] == "unstamped"
    assert rep["machine"]["cpu_model"] == "Fake CPU" and rep["machine"]["python"] == "3.11.2"
    assert rep["machine"]["cpu_cores"] is None and rep["machine"]["gpu"] is None
    assert rep["versions"] == {}
    assert rep["rlhf_kernels"]["git_commit"] == "fromcommitinfo"
    assert rep["rlhf_kernels"]["git_dirty"] is True


def test_report_writes_json_and_png(tmp_path):
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_fake_raw(stamped=True)))
    out = tmp_path / "out"
    assert report.main(["--raw", str(raw), "--out-dir", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    stems = ["g-one", "g_two", "ungrouped"]
    assert names == sorted(
        f"{s}-h100-80gb-hbm3-quick-2026-01-02.{e}" for s in stems for e in ("json", "png")
    )
    data = json.loads((out / "g-one-h100-80gb-hbm3-quick-2026-01-02.json").read_text())
    assert [x["name"] for x in data["benchmarks"]] == ["test_a[3]", "test_b[3]"]
    assert (out / "g_two-h100-80gb-hbm3-quick-2026-01-02.png").read_bytes()[:4] == b"\x89PNG"
    assert report.main(["--raw", str(tmp_path / "missing.json")]) == 1
    # a second report of the same day is refused unless --force (it overwrote committed files)
    kept = data
    assert report.main(["--raw", str(raw), "--out-dir", str(out)]) == 1
    assert json.loads((out / "g-one-h100-80gb-hbm3-quick-2026-01-02.json").read_text()) == kept
    assert report.main(["--raw", str(raw), "--out-dir", str(out), "--force"]) == 0
    # a report this script wrote is not raw pytest-benchmark JSON (it made an all-null report)
    done = out / "g-one-h100-80gb-hbm3-quick-2026-01-02.json"
    assert report.main(["--raw", str(done), "--out-dir", str(tmp_path / "o2")]) == 1


def test_report_refuses_groups_that_share_a_file_name(tmp_path, capsys):
    raw = _fake_raw(stamped=True)
    raw["benchmarks"][2]["group"] = "g one"  # "g-one" and "g one": g-one / g_one, both fine
    raw["benchmarks"][3]["group"] = "g/one"  # "g one" and "g/one": both g_one
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    out = tmp_path / "out"
    assert report.main(["--raw", str(path), "--out-dir", str(out), "--no-plot"]) == 1
    assert "groups 'g one' and 'g/one' would both write g_one-" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())  # nothing half-written


@pytest.mark.parametrize(
    "flag, value",
    [("--date", "2026/01/02"), ("--date", "yesterday"), ("--tag", "a/b"), ("--tag", "")],
)
def test_report_refuses_a_date_or_tag_that_is_no_file_name_part(flag, value, tmp_path, capsys):
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_fake_raw(stamped=True)))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:  # argparse's usage error, before anything is written
        report.main(["--raw", str(raw), "--out-dir", str(out), flag, value])
    assert e.value.code == 2 and not out.exists()
    assert repr(value) in capsys.readouterr().err
    # well-formed values name the files
    assert report.main(["--raw", str(raw), "--out-dir", str(out), "--date", "2026-03-04"]) == 0
    assert report.main(["--raw", str(raw), "--out-dir", str(out), "--tag", "h1.x+2"]) == 0
    names = {p.name for p in out.iterdir()}
    assert "g-one-h100-80gb-hbm3-quick-2026-03-04.json" in names
    assert "g-one-h1.x+2-quick-2026-01-02.json" in names


SCRIPTS = {  # bench script -> its results name on a machine without a GPU
    "bench_comm": "comm-cpu",
    "bench_liger": "liger-cpu",
    "bench_ppo": "ppo-rollout-cpu",
    "bench_ring": "ring-cpu",
    "bench_rl_math": "rl_math-cpu",
    "bench_trainers": "trainers-sft-cpu",
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_bench_scripts_parse_their_flags_and_keep_results(script, tmp_path, monkeypatch, capsys):
    """--help prints the flags and an unknown flag is an error, before any work (both used to
    start the full benchmark); the script stops before any work when today's results file of
    its name exists, unless --force."""
    import datetime
    import importlib

    if torch.cuda.is_available():
        pytest.skip("results names carry the GPU's name")
    mod = importlib.import_module(f"bench.{script}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--force" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        mod.main(["--quick", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    monkeypatch.setattr(report, "DEFAULT_OUT", tmp_path)
    today = datetime.date.today().isoformat()
    kept = tmp_path / f"{SCRIPTS[script]}-quick-{today}.json"
    kept.write_text("{}")
    with pytest.raises(SystemExit, match="exists .* pass --force to overwrite"):
        mod.main(["--quick"])
    assert kept.read_text() == "{}"
    assert report.results_stem("x", True, True) == tmp_path / f"x-quick-{today}"
    assert report.results_stem("x", False, False, date="2026-01-02") == tmp_path / "x-2026-01-02"


def _timed_call_lines(fn: ast.FunctionDef) -> list[int]:
    return [
        n.lineno
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == "benchmark")
            or (isinstance(n.func, ast.Attribute) and n.func.attr in ("pedantic", "__call__"))
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "benchmark"
        )
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("bench_*.py")), ids=lambda p: p.name)
def test_benchmark_group_is_set_before_the_timed_call(path):
    # pytest-benchmark copies `benchmark.group` into its stats when the timed call runs: a
    # later assignment is lost and `make bench` files the rows under "ungrouped"
    tree = ast.parse(path.read_text())
    tests = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and "benchmark" in
             [a.arg for a in f.args.args]]  # fmt: skip
    assert tests, f"{path.name}: no test takes the benchmark fixture"
    for fn in tests:
        groups = [
            n.lineno
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == "group" for t in n.targets)
        ]
        timed = _timed_call_lines(fn)
        assert groups and timed, f"{path.name}:{fn.name} sets no group or times nothing"
        assert max(groups) < min(timed), f"{path.name}:{fn.name}: group set after timing"


def test_machine_tag():
    assert report.machine_tag({"gpu": None}) == "cpu"
    assert report.machine_tag({"gpu": "NVIDIA H200"}) == "h200"
    assert report.machine_tag({"gpu": "AMD Instinct MI300X"}) == "amd-instinct-mi300x"


def test_quick_flag(monkeypatch):
    class Cfg:
        def __init__(self, flag):
            self.flag = flag

        def getoption(self, name, default=None):
            return self.flag

    monkeypatch.delenv("RLHF_BENCH_QUICK", raising=False)
    assert not is_quick(Cfg(False)) and is_quick(Cfg(True))
    monkeypatch.setenv("RLHF_BENCH_QUICK", "1")
    assert is_quick(Cfg(False))
    monkeypatch.setenv("RLHF_BENCH_QUICK", "0")
    assert not is_quick(Cfg(False))


def test_attention_shapes_and_flops():
    lens = ba.uneven_lengths(8192, 32, 1024)
    assert sum(lens) == 8192 and max(lens) <= 1024 and min(lens[:-1]) >= 32
    full = {c.name: c for c in ba.cases(quick=False)}
    assert full["uniform16x512"].lengths == (512,) * 16
    assert full["uniform16x512-gqa8to2"].kv_heads == 2
    # causal: 2 matmuls x 2 flops x l*l*d, half masked -> 2*l*l*d per head
    assert ba.causal_flops([3, 5], 2, 4, "fwd") == 2 * (9 + 25) * 2 * 4
    # the fwd_bwd step times the forward and the backward (2.5x forward), as gpu_check counts
    assert ba.causal_flops([3, 5], 2, 4, "fwd_bwd") == 3.5 * ba.causal_flops([3, 5], 2, 4, "fwd")


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_peers_agree_on_a_tiny_pack(kv_heads):
    case = ba.Case("tiny", (5, 17, 1, 9), 4, kv_heads)
    batch = ba.packed_batch(case, torch.device("cpu"), torch.float32)
    for method in ("varlen_torch", "sdpa_loop", "sdpa_padded", "sdpa_dense_mask"):
        run, unpack_out, unpack_dq, leaves, dout, _ = ba.build(method, case, batch, "fwd_bwd")
        out = run()
        out.backward(dout)
        torch.testing.assert_close(unpack_out(out.detach()), batch["ref_out"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(unpack_dq(leaves[0].grad), batch["ref_dq"], atol=1e-4, rtol=1e-4)
    # the reference itself is the float64 per-sequence math
    from rlhf_kernels.ops.varlen_attention import varlen_attention_reference

    ref, _ = varlen_attention_reference(
        *(batch[n].double() for n in "qkv"), batch["cu"], batch["cu"], causal=True
    )
    torch.testing.assert_close(batch["ref_out"].double(), ref, atol=1e-5, rtol=1e-5)
    for method in ("varlen_triton", "varlen_flash_attn", "sdpa_flash_loop", "torch_varlen_attn"):
        with pytest.raises(ba.Skip, match="CUDA"):
            ba.build(method, case, batch, "fwd")


@pytest.mark.parametrize("case", ["grpo-sym", "grpo-cliphigher", "ce"])
def test_liger_bench_peers_agree(case):
    """bench_liger's implementations agree on a tiny batch (Liger itself only if installed)."""
    from bench import bench_liger as bl

    bl.check_case(case, bl.make_inputs(dict(B=2, T=16, H=8, V=64)))


@pytest.mark.slow
def test_gpu_check_ring_blocks_agree_with_single_device(monkeypatch):
    """``make gpu-check``'s ring part on a tiny pack (CPU, Triton interpreter): every rank's
    blocks run, and rank 0's out and dq equal single-device attention's."""
    from bench import gpu_check

    monkeypatch.setattr(gpu_check, "_bench", lambda fn, quick=False: (fn(), 1.0)[1])
    row = gpu_check.ring_block_work(64, 2, "cpu", heads=2, kv_heads=1, dim=16)
    assert row["world"] == 2 and len(row["rank_fwd_bwd_ms"]) == 2
    assert row["max_err_out"] < 1e-5 and row["max_err_dq"] < 1e-5, row
    assert row["rel_err_out"] < 1e-5 and row["rel_err_dq"] < 1e-5 and not row["mismatch"], row


def test_gpu_check_keeps_every_row_when_a_part_fails(monkeypatch, tmp_path):
    """A rare GPU slot must not lose its results: rows are on disk as they come, a failing part
    is recorded and the next part still runs, and the exit status says something failed."""
    from bench import gpu_check

    def good(quick):
        yield dict(method="a", ms=1.0)
        yield dict(method="b", ms=2.0)

    def bad(quick):
        yield dict(method="c", ms=3.0)
        raise RuntimeError("CUDA out of memory")

    on_disk = []

    def save(report, stem):  # what a kill right after this row would leave
        real_save(report, stem)
        on_disk.append(json.loads(Path(f"{stem}.json").read_text()))

    real_save = gpu_check._save
    monkeypatch.setattr(gpu_check, "_save", save)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    fake = dict(gpu="NVIDIA Fake GPU", torch="t", cuda="c", triton="tr", python="p")
    monkeypatch.setattr(gpu_check, "machine", lambda: dict(fake, rlhf_kernels_commit=None))
    monkeypatch.setattr(gpu_check, "PARTS", dict(linear=bad, gae=good))
    assert gpu_check.main(["--only", "linear", "gae", "--out-dir", str(tmp_path)]) == 1
    assert on_disk[0]["linear"] == [dict(method="c", ms=3.0)]  # before the failure
    (js,) = tmp_path.glob("gpu-check-fake-gpu-*.json")
    got = json.loads(js.read_text())
    assert got["linear"][0]["method"] == "c" and "out of memory" in got["linear"][1]["error"]
    assert [r["method"] for r in got["gae"]] == ["a", "b"] and got["unfinished"] == []
    assert "## Failed" in js.with_suffix(".md").read_text()
    # a budget stops starting rows and says what is unfinished, in a file of its own (the
    # first run's file stays as it was)
    assert gpu_check.main(["--only", "gae", "--budget-s", "0", "--out-dir", str(tmp_path)]) == 1
    assert json.loads(js.read_text()) == got
    (second,) = set(tmp_path.glob("gpu-check-fake-gpu-*.json")) - {js}
    assert json.loads(second.read_text())["unfinished"] == ["gae"]
    # make gpu-check's deadline caps the budget
    monkeypatch.setenv("GPU_CHECK_DEADLINE", str(time.time() - 1))
    assert gpu_check.main(["--only", "gae", "--budget-s", "600", "--out-dir", str(tmp_path)]) == 1
    newest = max(tmp_path.glob("gpu-check-fake-gpu-*.json"), key=lambda p: p.stat().st_mtime_ns)
    assert json.loads(newest.read_text())["unfinished"] == ["gae"]
    with pytest.raises(SystemExit):  # a misspelt part fails at once, not after the others
        gpu_check.main(["--only", "attention", "ring-tile"])


def test_gpu_check_exit_status_follows_our_rows(monkeypatch, tmp_path):
    """A peer's own failure (flex out of memory) is reported without failing the check; an
    error of ours or a mismatch (NaN included) fails it."""
    from bench import gpu_check

    fake = dict(gpu="NVIDIA Fake GPU", torch="t", cuda="c", triton="tr", python="p")
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda: dict(fake, rlhf_kernels_commit=None))

    def run(*rows):
        monkeypatch.setattr(gpu_check, "PARTS", dict(linear=lambda quick: iter(rows)))
        return gpu_check.main(["--only", "linear", "--out-dir", str(tmp_path)])

    assert run(dict(method="flex_doc_mask", error="OutOfMemoryError()")) == 0
    assert run(dict(method="ours_triton", error="RuntimeError()")) == 1
    assert run(dict(method="flash_attn", mismatch=True)) == 1
    assert not gpu_check._mismatch([1e-3, 4e-3])
    for bad in ([0.0, 0.5], [float("nan"), 0.0], [0.0, float("inf")]):
        assert gpu_check._mismatch(bad), bad
