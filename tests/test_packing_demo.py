import pytest

from trainers import packing_demo as demo


def test_demo_packed_and_padded_losses_agree(capsys):
    packed, padded = demo.main(["--steps", "2", "--batch-size", "8", "--seed", "3"])
    assert len(packed.losses) == len(padded.losses) == 2
    assert max(demo.loss_differences(packed, padded)) <= 1e-4
    assert packed.losses[1] < packed.losses[0]  # it trains
    assert packed.padding_fraction == 0.0 and padded.padding_fraction > 0.0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "padding fraction" in out and out.rstrip().endswith("1.0e-04")


def test_demo_exits_nonzero_when_losses_disagree(monkeypatch, capsys):
    fake = (demo.RunStats(losses=[1.0, 2.0]), demo.RunStats(losses=[1.0, 2.001]))
    monkeypatch.setattr(demo, "run", lambda args: fake)  # skip training: check main's verdict
    assert demo.loss_differences(*fake) == pytest.approx([0.0, 0.001])
    with pytest.raises(SystemExit) as e:
        demo.main(["--tol", "1e-4"])
    assert e.value.code == 1
    assert "FAIL" in capsys.readouterr().err
    assert demo.main(["--tol", "1e-2"]) == fake


def test_demo_cli_validation_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--steps",
        "--batch-size",
        "--max-tokens",
        "--max-len",
        "--lr",
        "--seed",
        "--tol",
        "--data",
    ):
        assert flag in text
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--max-len", "4096", "--max-tokens", "1024"])


def test_byte_tokenizer_roundtrip():
    tok = demo.ByteTokenizer()
    ids = tok.encode("héllo", max_len=64)
    assert ids[0] == tok.bos and ids[-1] == tok.eos and tok.decode(ids.tolist()) == "héllo"
    assert len(tok.encode("x" * 100, max_len=10)) == 10
