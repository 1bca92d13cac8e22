"""Audit of trainers.data / packing_demo / demo: bad input refused up front, NaN never passes."""

import math

import pytest

from trainers import packing_demo


# ---------------------------------------------------------------- packing_demo
@pytest.mark.parametrize(
    "text, match",
    [
        ("", "at least one JSON line"),  # an empty corpus looped forever filling a batch
        ("\n  \n", "at least one JSON line"),
        ('{"txt": "a"}\n', "line 1: expected a JSON object with a text 'text'"),  # KeyError
        ('{"text": "ok"}\n{"text": 5}\n', "line 2: expected"),  # AttributeError
        ('["text"]\n', "line 1: expected"),
        ("{oops\n", "line 1: expected"),
    ],
)
def test_packing_demo_refuses_a_bad_corpus_before_training(tmp_path, capsys, text, match):
    path = tmp_path / "corpus.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        packing_demo.parse_args(["--data", str(path)])
    assert e.value.code == 2 and match in capsys.readouterr().err
    with pytest.raises(ValueError, match=match):
        packing_demo.load_samples(path, 16)


def test_packing_demo_refuses_a_missing_corpus(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        packing_demo.parse_args(["--data", str(tmp_path / "nope.jsonl")])
    assert e.value.code == 2 and "nope.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--tol", "nan"], ["--lr", "inf"], ["--lr", "nan"]])
def test_packing_demo_refuses_nan_tol_and_lr(flags):
    with pytest.raises(SystemExit) as e:  # --tol nan: no difference is > NaN, every run passed
        packing_demo.parse_args(flags)
    assert e.value.code == 2


@pytest.mark.parametrize(
    "packed, padded",
    [([1.0, math.nan], [1.0, math.nan]), ([math.nan, 1.0], [1.0, 1.0]), ([1.0], [math.inf])],
)
def test_packing_demo_fails_on_nan_losses(monkeypatch, capsys, packed, padded):
    fake = (packing_demo.RunStats(losses=packed), packing_demo.RunStats(losses=padded))
    monkeypatch.setattr(packing_demo, "run", lambda args: fake)
    with pytest.raises(SystemExit) as e:  # a NaN difference printed "OK"
        packing_demo.main(["--tol", "1e-4"])
    assert e.value.code == 1 and "FAIL" in capsys.readouterr().err


def test_packing_demo_loads_the_bundled_corpus_and_skips_blank_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ab"}\n\n{"text": "héllo", "id": 3}\n')
    samples = packing_demo.load_samples(path, 4)
    assert [s.tolist() for s in samples] == [[256, 97, 98, 257], [256, 104, 195, 169]]
    assert len(packing_demo.load_samples(packing_demo.DATA, 256)) == 70


# ---------------------------------------------------------------- toy data generator
def _toy_module():
    import importlib.util

    from trainers import data

    spec = importlib.util.spec_from_file_location("make_toy", data.DATA_DIR / "make_toy_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_toy_data_writes_into_a_new_folder(tmp_path):
    out = tmp_path / "new" / "toy"  # raised FileNotFoundError: the folder was never made
    mod = _toy_module()
    assert mod.main(["--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(mod.FILES)
    assert mod.main(["--check", "--out", str(tmp_path / "absent")]) == 1
    assert not (tmp_path / "absent").exists()  # --check writes nothing


# ---------------------------------------------------------------- trainers.data
def test_csv_written_by_pandas_with_its_index_loads(tmp_path):
    """``DataFrame.to_csv()`` writes an unnamed index column: the text features named it ''
    where pandas reads 'Unnamed: 0', and loading failed ('Field "" does not exist')."""
    from trainers.data import load_mixture

    path = tmp_path / "pd.csv"
    path.write_text(",prompt,response\n0,hi,ho\n1,0007,x\n")
    rows = load_mixture(str(path), None, "train", 0, None)
    assert rows.column_names == ["Unnamed: 0", "prompt", "response"]
    assert rows["prompt"] == ["hi", "0007"] and rows["Unnamed: 0"] == ["0", "1"]


def test_csv_text_that_pandas_calls_missing_stays_text(tmp_path):
    """Text "NA", "None", "null", "N/A" is an answer, not a missing value: it became None and the
    run was refused ('holds NoneType None, expected text'). Only an empty cell is missing."""
    from trainers.data import check_values, load_mixture

    path = tmp_path / "na.csv"
    path.write_text("prompt,response\nNA,None\nnull,N/A\nnan,\n")
    rows = load_mixture(str(path), None, "train", 0, None)
    assert rows["prompt"] == ["NA", "null", "nan"] and rows["response"] == ["None", "N/A", None]
    check_values(rows.select([0, 1]), {"--input-key": "prompt", "--output-key": "response"}, "d")
    with pytest.raises(ValueError, match="row 2"):
        check_values(rows, {"--output-key": "response"}, "d")


def test_csv_repeated_column_name_is_kept_not_dropped(tmp_path):
    from trainers.data import load_mixture

    path = tmp_path / "dup.csv"
    path.write_text("prompt,prompt\nhi,ho\n")  # the second column was silently dropped
    rows = load_mixture(str(path), None, "train", 0, None)
    assert rows.column_names == ["prompt", "prompt.1"]
    assert rows[0] == {"prompt": "hi", "prompt.1": "ho"}


def test_csv_that_is_not_csv_is_one_clear_error(tmp_path):
    from trainers.data import load_mixture

    path = tmp_path / "blank.csv"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="blank.csv.*(csv|no rows)"):
        load_mixture(str(path), None, "train", 0, None)


def test_holdout_size_is_the_nearest_count():
    import datasets

    from trainers.data import split_train_eval

    ds = datasets.Dataset.from_dict({"i": list(range(10))})
    train, held = split_train_eval(ds, None, 0.19, 0)  # 1.9 rows: 2 (int() gave 1)
    assert (len(train), len(held)) == (8, 2)


def test_check_values_refuses_booleans_as_text():
    import datasets

    from trainers.data import check_values

    ds = datasets.Dataset.from_list([{"p": "a", "r": True}, {"p": "b", "r": False}])
    with pytest.raises(ValueError, match=r"--output-key 'r': row 0 .*bool True, expected text"):
        check_values(ds, {"--input-key": "p", "--output-key": "r"}, "data")  # trained 'True'
    check_values(datasets.Dataset.from_list([{"p": 7}]), {"--input-key": "p"}, "data")  # digits


class _ByteTok:
    """Enough of a tokenizer for the plain-text paths: bytes, no BOS, EOS 300."""

    eos_token_id = 300

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


def test_tokenize_pair_refuses_max_len_below_two():
    from trainers.data import tokenize_pair, tokenize_sft

    tok = _ByteTok()
    with pytest.raises(ValueError, match="max_len: expected an int >= 2, got 1"):
        tokenize_pair(tok, "", "a", "b", 1)  # (returned None: looked like a long prompt)
    assert tokenize_pair(tok, "", "a", "b", 2) == {
        "chosen_ids": [97, 300],
        "rejected_ids": [98, 300],
    }
    assert tokenize_sft(tok, "", "a", 1) == {"input_ids": [97], "loss_mask": [1]}


def test_an_empty_message_list_is_not_chat():
    import datasets

    from trainers.data import check_values, is_chat

    assert not is_chat([]) and is_chat([{"role": "user", "content": "hi"}])
    ds = datasets.Dataset.from_list([{"p": [{"role": "user", "content": "hi"}]}, {"p": []}])
    with pytest.raises(ValueError, match=r"--input-key 'p': row 1 .*expected text or a list"):
        check_values(ds, {"--input-key": "p"}, "data", chat_flag="--input-key")


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mixture_of_datasets_sharing_no_column_is_refused(tmp_path):
    from trainers.data import load_mixture

    both = (
        f"{_jsonl(tmp_path / 'a.jsonl', [{'q': 'x'}])},{_jsonl(tmp_path / 'b.jsonl', [{'p': 'y'}])}"
    )
    for probs in (None, "1,1"):
        with pytest.raises(ValueError, match=r"sharing at least one column.*\[\['q'\], \['p'\]\]"):
            load_mixture(both, probs, "train", 0, None)


def test_probs_mixture_names_the_dropped_columns(tmp_path):
    from trainers.data import check_keys, load_mixture

    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "extra": i} for i in range(4)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(4)])
    mixed = load_mixture(f"{a},{b}", "1,1", "train", 0, None)
    with pytest.raises(ValueError, match=r"--label-key 'extra' .*dropped.*\['extra'\]"):
        check_keys(mixed, {"--label-key": "extra"}, "training dataset")


def test_max_samples_keeps_exactly_the_first_n(tmp_path):
    from trainers.data import load_mixture

    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    for n, want in ((4, 4), (1, 1), (5, 5), (9, 5)):
        rows = load_mixture(path, None, "train", 0, n)
        assert rows["prompt"] == [f"p{i}" for i in range(want)]


# ---------------------------------------------------------------- demo (make demo) driver
def _fake_demo(monkeypatch, rewards, evals=(0.25, 0.5, 0.75)):
    pytest.importorskip("deepspeed")  # (trainers.demo's test file needs it too)
    from trainers import demo

    calls = []
    monkeypatch.setattr(demo, "run", lambda module, args: calls.append((module, args)) or 1.0)
    monkeypatch.setattr(demo, "write_prompts", lambda path: path)
    m = [{"reward_mean": r} for r in rewards]
    m[0]["eval_reward_before"] = evals[0]
    m[1]["eval_reward"], m[-1]["eval_reward"] = evals[1], evals[2]
    monkeypatch.setattr(demo, "read", lambda path: m)
    return demo, calls


def test_demo_driver_commands_table_and_verdict(monkeypatch, tmp_path, capsys):
    demo, calls = _fake_demo(monkeypatch, [0.0, 0.1, 0.2, 0.4, 0.5, 0.6, 0.7])
    out = tmp_path / "d"
    result = demo.main(["--output-dir", str(out), "--rl-steps", "7", "--seed", "5"])
    assert result == {
        "first": pytest.approx(0.1),
        "last": pytest.approx(0.6),
        "evals": [0.25, 0.5, 0.75],
    }
    (sft, sft_args), (ppo, ppo_args) = calls
    assert (sft, ppo) == ("sft", "ppo") and sft_args[-1] == "--overwrite"
    assert sft_args[sft_args.index("--seed") + 1] == "5" == ppo_args[ppo_args.index("--seed") + 1]
    assert ppo_args[ppo_args.index("--max-steps") + 1] == "7"
    assert ppo_args[ppo_args.index("--model") + 1] == str(out / "sft" / "model")
    assert "OK: RL raised the mean sampled reward by 0.500" in capsys.readouterr().out
    demo.main(["--output-dir", str(out)])
    assert "--max-steps" not in calls[-1][1]  # trainers.ppo's default


def test_demo_gain_at_the_threshold_passes_below_fails(monkeypatch, capsys):
    demo, _ = _fake_demo(monkeypatch, [0.0, 0.0, 0.25, 0.25])
    assert demo.main(["--min-gain", "0.25"])["last"] == 0.25  # equal: passes
    with pytest.raises(SystemExit) as e:
        demo.main(["--min-gain", "0.2500001"])
    assert e.value.code == 1 and "FAIL: reward gain 0.250" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--seed", str(2**32)])
    assert e.value.code == 2


def test_mixing_a_json_column_of_text_and_numbers_keeps_the_text(tmp_path):
    """A jsonl column holding 5 and "five" is a ``Json`` feature: mixed with a text file it was
    cast to its JSON, so the model trained on '"five"' with the quotes; mixed after an int file
    it was an error."""
    import datasets

    from trainers.data import load_mixture

    if not hasattr(datasets, "Json"):
        pytest.skip("datasets < 5 reads no column of mixed types")

    mix = _jsonl(tmp_path / "m.jsonl", [{"p": "a", "r": 5}, {"p": "b", "r": "five"}])
    text = _jsonl(tmp_path / "t.jsonl", [{"p": "c", "r": "six"}])
    ints = _jsonl(tmp_path / "i.jsonl", [{"p": "e", "r": 7}])
    assert load_mixture(f"{mix},{text}", None, "train", 0, None)["r"] == ["5", "five", "six"]
    assert load_mixture(f"{text},{mix}", None, "train", 0, None)["r"] == ["six", "5", "five"]
    assert load_mixture(f"{ints},{mix}", None, "train", 0, None)["r"] == ["7", "5", "five"]
    assert sorted(set(load_mixture(f"{ints},{mix}", "1,1", "train", 0, None)["r"])) == [
        "5",
        "7",
        "five",
    ]
