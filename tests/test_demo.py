"""``make demo``: SFT warm start, then GRPO on a toy task; the reward must rise by 0.2."""

import pytest

from trainers import demo

pytest.importorskip("deepspeed")


def test_prompts_are_first_letter_questions(tmp_path):
    import json

    rows = [json.loads(x) for x in demo.write_prompts(tmp_path / "p.jsonl", n=50).open()]
    assert len(rows) == 50 and len({r["prompt"] for r in rows}) > 40
    for r in rows:
        word = r["prompt"].removeprefix("first letter: ")
        assert 3 <= len(word) <= 8 and word.isalpha() and r["target"] == word[0]


@pytest.mark.slow
def test_demo_raises_the_reward(tmp_path, capsys):
    result = demo.main(["--output-dir", str(tmp_path)])
    assert result["last"] - result["first"] >= 0.2
    assert result["evals"][-1] > result["evals"][0]
    assert (tmp_path / "ppo" / "metrics.png").is_file()
    out = capsys.readouterr().out
    assert "before RL" in out and "OK: RL raised" in out


def test_gain_windows_never_overlap():
    # windows of 3 of a 3-step run were the same steps (gain 0); 2 steps were divided by 3
    assert demo.gain_windows([0.0, 0.5, 1.0]) == (1, 0.0, 1.0)
    assert demo.gain_windows([0.1, 0.4]) == (1, 0.1, 0.4)
    assert demo.gain_windows([0, 0, 0, 1, 1, 1, 1]) == (3, 0.0, 1.0)
    with pytest.raises(ValueError, match="at least 2 RL steps, got 1"):
        demo.gain_windows([0.3])
    with pytest.raises(SystemExit):
        demo.parse_args(["--rl-steps", "1"])
    with pytest.raises(SystemExit):  # NaN: every gain passed the check
        demo.parse_args(["--min-gain", "nan"])


def test_bad_demo_arguments_and_failed_stages_end_in_one_line(tmp_path, capsys, monkeypatch):
    """--sft-steps 0 ran the SFT stage into a CalledProcessError traceback; now argparse
    refuses it, and a failing stage ends the demo with that stage's exit code."""
    import subprocess
    from types import SimpleNamespace

    import pytest

    from trainers import demo

    for flags in (["--sft-steps", "0"], ["--seed", "-1"], ["--rl-steps", "1"]):
        with pytest.raises(SystemExit) as e:
            demo.parse_args(flags)
        assert e.value.code == 2
    monkeypatch.setattr(subprocess, "run", lambda cmd: SimpleNamespace(returncode=2))
    with pytest.raises(SystemExit) as e:
        demo.run("sft", ["--output-dir", str(tmp_path)])
    assert e.value.code == 2 and "the sft stage failed (exit code 2)" in capsys.readouterr().err
