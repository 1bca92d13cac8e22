"""trainers.tiny (offline, deterministic tiny Llama) and trainers.data (loading, tokenising)."""

import importlib.util
import json
import threading
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

from trainers import data, tiny
from trainers.data import (
    check_keys,
    load_mixture,
    make_default_path,
    render_prompt,
    render_response,
    split_train_eval,
    tokenize_pair,
    tokenize_sft,
)

ROWS = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(6)]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny.ensure_tiny(tmp_path_factory.mktemp("tiny") / tiny.TINY_VERSION)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------- tiny model


def test_build_is_deterministic_and_leaves_rng(tiny_dir, tmp_path):
    before = torch.random.get_rng_state()
    other = tiny.ensure_tiny(tmp_path / "b")
    assert torch.equal(torch.random.get_rng_state(), before)
    a, b = Path(tiny_dir), Path(other)
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(t.dtype == torch.float32 for t in wa.values())


def test_existing_folder_is_only_loaded(tiny_dir, monkeypatch):
    monkeypatch.setattr(tiny, "_build", lambda dst: pytest.fail("rebuilt a complete folder"))
    assert tiny.ensure_tiny(tiny_dir) == tiny_dir
    monkeypatch.setenv("RLHF_KERNELS_TINY", tiny_dir)
    assert tiny.ensure_tiny() == tiny_dir
    monkeypatch.delenv("RLHF_KERNELS_TINY")
    assert tiny.default_path() == Path.home() / ".cache" / "rlhf-kernels" / "tiny-v1"


def test_concurrent_builders_share_one_folder(tmp_path, monkeypatch):
    real_build, barrier, built = tiny._build, threading.Barrier(2, timeout=60), []

    def build_then_wait(dst):  # both builders finish building before either renames
        real_build(dst)
        built.append(dst)
        barrier.wait()

    monkeypatch.setattr(tiny, "_build", build_then_wait)
    dst, results, errors = tmp_path / "shared", [], []

    def worker():
        try:
            results.append(tiny.ensure_tiny(dst))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [str(dst)] * 2 and len(built) == 2
    assert tiny.is_complete(dst) and _leftovers(tmp_path) == []


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(dst):
        (dst / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny, "_build", broken)
    with pytest.raises(RuntimeError, match="boom"):
        tiny.ensure_tiny(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_foreign_nonempty_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="config.json"):
        tiny.ensure_tiny(tmp_path / "m")


def test_tokenizer_specials_and_round_trip(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(6))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) == tiny.VOCAB_SIZE
    text = "reverse: abcd -> dcba\n  héllo wörld 🙂\ttabs"
    enc = tok.encode(text)
    assert enc[0] == tok.bos_token_id and tok.unk_token_id is None
    assert tok.decode(enc, skip_special_tokens=True) == text
    assert tok.encode("<|user|>x", add_special_tokens=False)[0] == ids["<|user|>"]


def test_chat_template(tok):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse: abcd"},
        {"role": "assistant", "content": "dcba"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|bos|><|system|>be brief<|user|>reverse: abcd<|assistant|>dcba<|eos|>"
    gen = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True)
    assert gen == "<|bos|><|user|>reverse: abcd<|assistant|>"
    ids = render_prompt(tok, "reverse: abcd", None, True)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == tok.encode(gen, add_special_tokens=False)
    assert ids[:2] == [0, 3] and ids[-1] == 4


class _FakeChatTokenizer:
    """Stands in for old (list) and new (BatchEncoding) apply_chat_template returns."""

    chat_template = "x"

    def __init__(self, out):
        self.out = out

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert messages == [{"role": "user", "content": "Q: hi"}] and add_generation_prompt
        return self.out


@pytest.mark.parametrize(
    "out",
    [
        [5, 6, 7],
        [[5, 6, 7]],
        BatchEncoding({"input_ids": [5, 6, 7]}),
        {"input_ids": torch.tensor([[5, 6, 7]])},
    ],
)
def test_render_prompt_chat_return_types(out):
    assert render_prompt(_FakeChatTokenizer(out), "hi", "Q: {}", True) == [5, 6, 7]


def test_render_prompt_errors(tok):
    with pytest.raises(ValueError, match=r"input_template 'Q: ' has no '\{\}'"):
        render_prompt(tok, "hi", "Q: ", False)
    no_template = _FakeChatTokenizer([1])
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        render_prompt(no_template, "hi", None, True)


def test_model_reloads(tiny_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 176, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == len(tok) and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)
    assert model.dtype == torch.float32
    ids = torch.tensor([tok.encode("sort: dbca")])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


# ---------------------------------------------------------------- loading and mixing


def _write(tmp_path: Path, fmt: str, rows=ROWS) -> str:
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_load_formats(tmp_path, fmt):
    ds = load_mixture(_write(tmp_path, fmt), None, "train", 0, None)
    assert ds.to_list() == ROWS
    assert len(load_mixture(_write(tmp_path, fmt), None, "train", 0, 4)) == 4
    with pytest.raises(ValueError, match=r"split 'test'.*expected one of \['train'\]"):
        load_mixture(_write(tmp_path, fmt), None, "test", 0, None)


def test_load_dataset_dict_splits(tmp_path):
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:4]), test=datasets.Dataset.from_list(ROWS[4:])
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_mixture(str(tmp_path / "dd"), None, "test", 0, None).to_list() == ROWS[4:]
    assert len(load_mixture(str(tmp_path / "dd"), None, "train", 0, None)) == 4
    with pytest.raises(ValueError, match=r"'validation'.*\['train', 'test'\]"):
        load_mixture(str(tmp_path / "dd"), None, "validation", 0, None)
    # a saved split of 0 rows: datasets raises IndexError loading it (the whole dict, before)
    dd["test"] = dd["test"].select([])
    dd.save_to_disk(str(tmp_path / "dd0"))
    assert len(load_mixture(str(tmp_path / "dd0"), None, "train", 0, None)) == 4
    with pytest.raises(ValueError, match="dd0': split 'test' holds no rows"):
        load_mixture(str(tmp_path / "dd0"), None, "test", 0, None)


def test_empty_or_malformed_files_are_one_clear_error(tmp_path):
    cases = {
        "empty.jsonl": ("", "the file is empty"),
        "blank.jsonl": ("\n\n", "the file holds no rows"),
        "header.csv": ("prompt\n", "the file holds no rows"),
        "cut.jsonl": ('{"prompt": "a"}\n{"prompt": \n', "cannot be read as json"),
        "text.parquet": ("not parquet", "cannot be read as parquet"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{name}'.*{message}"):
            load_mixture(str(tmp_path / name), None, "train", 0, None)
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "zero.parquet"))
    with pytest.raises(ValueError, match="zero.parquet': the file holds no rows"):
        load_mixture(str(tmp_path / "zero.parquet"), None, "train", 0, None)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="folder': expected a folder written by save_to_disk"):
        load_mixture(str(tmp_path / "folder"), None, "train", 0, None)


def test_load_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_mixture(f"{_write(tmp_path, 'jsonl')},{missing}", None, "train", 0, None)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"suffix '\.txt'"):
        load_mixture(str(tmp_path / "x.txt"), None, "train", 0, None)
    with pytest.raises(ValueError, match="max_samples"):
        load_mixture(_write(tmp_path, "jsonl"), None, "train", 0, 0)


def _two_sources(tmp_path: Path, n: int = 1000) -> str:
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir(), b.mkdir()
    pa = _write(a, "jsonl", [{"prompt": f"a{i}", "src": "a", "extra": i} for i in range(n)])
    pb = _write(b, "parquet", [{"prompt": f"b{i}", "src": "b"} for i in range(n)])
    return f"{pa}, {pb}"


def test_probs_mixing(tmp_path):
    both = _two_sources(tmp_path)
    head = load_mixture(both, "3,1", "train", 0, 400)
    assert len(head) == 400 and 260 <= head["src"].count("a") <= 340
    full = load_mixture(both, "0.5,0.5", "train", 0, None)
    assert {p for p in full["prompt"] if p.startswith("b")} == {f"b{i}" for i in range(1000)}
    assert head["prompt"] == load_mixture(both, "3,1", "train", 0, 400)["prompt"]
    assert head["prompt"] != load_mixture(both, "3,1", "train", 1, 400)["prompt"]
    for bad in ("1", "1,2,3", "1,0", "1,-1", "1,x"):
        with pytest.raises(ValueError, match="probs"):
            load_mixture(both, bad, "train", 0, None)


def test_concat_keeps_common_columns(tmp_path):
    ds = load_mixture(_two_sources(tmp_path, 5), None, "train", 0, None)
    assert ds.column_names == ["prompt", "src"]
    assert ds["src"] == ["a"] * 5 + ["b"] * 5
    with pytest.raises(ValueError, match=r"--label-key 'extra' .*dropped.*\['extra'\]"):
        check_keys(ds, {"--label-key": "extra"}, "training dataset")


def test_mixed_column_types(tmp_path):
    """Numbers in one file, text in the other: text in either order (the order used to decide
    between working and an error naming neither dataset nor column)."""
    files = {
        "ints": [{"prompt": f"p{i}", "response": i} for i in range(3)],
        "strs": [{"prompt": "q", "response": "word"}] * 3,
        "lists": [{"prompt": "q", "response": [1, 2]}] * 3,
    }
    for name, rows in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ints, strs, lists = (str(tmp_path / f"{n}.jsonl") for n in files)
    assert load_mixture(f"{ints},{strs}", None, "train", 0, None)["response"][2:4] == ["2", "word"]
    assert load_mixture(f"{strs},{ints}", None, "train", 0, None)["response"][2:4] == ["word", "0"]
    with pytest.raises(ValueError, match="lists.jsonl': cannot be mixed with '.*ints.jsonl'"):
        load_mixture(f"{ints},{lists}", None, "train", 0, None)
    # a CSV's text stays text after a file of numbers ("0007" used to become 7, as the
    # first part's type decided), in either order
    (tmp_path / "nums.csv").write_text("prompt,response\nz,0007\n")
    mixed = load_mixture(f"{ints},{tmp_path / 'nums.csv'}", None, "train", 0, None)
    assert mixed["response"] == ["0", "1", "2", "0007"]
    # ints then floats (a margin, an unread score column) used to be refused: both float64
    floats = tmp_path / "floats.jsonl"
    floats.write_text(json.dumps({"prompt": "f", "response": 1.5}) + "\n")
    for order in ((ints, floats), (floats, ints)):
        mixed = load_mixture(",".join(map(str, order)), None, "train", 0, None)
        assert sorted(mixed["response"]) == [0.0, 1.0, 1.5, 2.0]
    # class labels mixed with text keep their names (not "0" / "1")
    labelled = datasets.Dataset.from_dict(
        {"prompt": ["a", "b"], "response": [0, 1]},
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "response": datasets.ClassLabel(names=["no", "yes"]),
            }
        ),
    )
    labelled.save_to_disk(str(tmp_path / "labelled"))
    mixed = load_mixture(f"{tmp_path / 'labelled'},{strs}", None, "train", 0, None)
    assert mixed["response"][:3] == ["no", "yes", "word"]
    missing = datasets.Dataset.from_dict(  # -1 and None: no label (not a crash)
        {"prompt": ["a", "b"], "response": [-1, None]}, features=labelled.features
    )
    missing.save_to_disk(str(tmp_path / "missing"))
    mixed = load_mixture(f"{tmp_path / 'missing'},{strs}", None, "train", 0, None)
    assert mixed["response"][:3] == [None, None, "word"]
    swapped = datasets.Dataset.from_dict(  # the same names in another order: label 0 is "yes"
        {"prompt": ["c"], "response": [0]},
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "response": datasets.ClassLabel(names=["yes", "no"]),
            }
        ),
    )
    swapped.save_to_disk(str(tmp_path / "swapped"))
    mixed = load_mixture(f"{tmp_path / 'labelled'},{tmp_path / 'swapped'}", None, "train", 0, None)
    assert mixed["response"] == ["no", "yes", "yes"]  # was cast by number: "no", "yes", "no"


def test_check_keys_message():
    ds = datasets.Dataset.from_list(ROWS)
    check_keys(ds, {"--input-key": "prompt", "--output-key": "response", "--label": None}, "x")
    msg = (
        "--input-key 'question' is not a column of the training dataset; "
        "columns: ['prompt', 'response']"
    )
    with pytest.raises(ValueError) as err:
        check_keys(ds, {"--input-key": "question"}, "training dataset")
    assert str(err.value) == msg


def test_split_train_eval():
    ds = datasets.Dataset.from_list([{"i": i} for i in range(100)])
    train, ev = split_train_eval(ds, None, 0.1, seed=3)
    assert (len(train), len(ev)) == (90, 10)
    assert set(train["i"]).isdisjoint(ev["i"]) and set(train["i"]) | set(ev["i"]) == set(range(100))
    assert ev["i"] == split_train_eval(ds, None, 0.1, seed=3)[1]["i"]
    assert ev["i"] != split_train_eval(ds, None, 0.1, seed=4)[1]["i"]
    assert ev["i"] != list(range(10))  # random, not the head
    given = datasets.Dataset.from_list([{"i": -1}])
    assert split_train_eval(ds, given, 0.1, 0) == (ds, given)
    assert split_train_eval(ds, None, 0.0, 0) == (ds, None)
    two = ds.select([0, 1])
    assert [len(x) for x in split_train_eval(two, None, 0.9, 0)] == [1, 1]
    assert [len(x) for x in split_train_eval(ds, None, 0.001, 0)] == [99, 1]
    # an id column made every row unique: duplicates of held-out content stayed in training
    rows = [{"id": i, "prompt": f"q{i % 10}", "response": f"a{i % 10}"} for i in range(100)]
    ds = datasets.Dataset.from_list(rows)
    train, ev = split_train_eval(ds, None, 0.1, 0, columns=["prompt", "response"])
    assert set(train["prompt"]).isdisjoint(ev["prompt"]) and len(ev) == 10
    assert len(split_train_eval(ds, None, 0.1, 0)[0]) == 90  # all columns: ids differ
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="eval_ratio"):
            split_train_eval(ds, None, bad, 0)
    with pytest.raises(ValueError, match="at least 2"):
        split_train_eval(ds.select([0]), None, 0.5, 0)
    with pytest.raises(ValueError, match="every training row equals a held-out row"):
        split_train_eval(datasets.Dataset.from_list([{"i": 1}] * 5), None, 0.2, 0)


def test_holdout_of_a_probs_mixture_is_never_trained_on(tmp_path):
    """Mixing repeats the smaller dataset's rows: 11 of 22 held-out rows were also in training."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    mix = f"{_write(a, 'jsonl', [{'prompt': f'a{i}'} for i in range(200)])},"
    mix += _write(b, "jsonl", [{"prompt": f"b{i}"} for i in range(20)])
    rows = load_mixture(mix, "0.5,0.5", "train", 0, None)
    assert len(rows) > len(set(rows["prompt"]))  # b's rows repeat
    train, ev = split_train_eval(rows, None, 0.05, 0)
    assert set(train["prompt"]).isdisjoint(ev["prompt"])
    assert len(ev) == round(0.05 * len(rows)) and len(train) >= 200


# ---------------------------------------------------------------- tokenisation


def test_tokenize_sft_mask_and_eos(tok):
    prompt_ids = tok.encode("reverse: abcd")
    resp_ids = tok.encode("dcba", add_special_tokens=False)
    out = tokenize_sft(tok, "reverse: abcd", "dcba", 64)
    assert out["input_ids"] == prompt_ids + resp_ids + [tok.eos_token_id]
    assert out["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(resp_ids) + 1)
    chat = tokenize_sft(
        tok, "abcd", "dcba", 64, input_template="reverse: {}", apply_chat_template=True
    )
    n = len(render_prompt(tok, "reverse: abcd", None, True))
    assert chat["input_ids"][n - 1] == 4 and chat["input_ids"][-1] == tok.eos_token_id
    assert chat["loss_mask"] == [0] * n + [1] * (len(chat["input_ids"]) - n)


# a Qwen/ChatML-like template: the assistant turn ends with its own marker (<|system|>, id 5,
# stands in for <|im_end|>) and a newline, not with the tokenizer's EOS
END_OF_TURN = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>"
    "{% endif %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|system|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_template_responses_end_with_the_templates_end_of_turn(tiny_dir):
    """With --apply-chat-template the trained response is the template's assistant turn: its
    end-of-turn marker is learnt (generation stops there), then one EOS; a template that ends
    turns with EOS (the bundled one) gets no second EOS."""
    chatml = AutoTokenizer.from_pretrained(tiny_dir)
    chatml.chat_template = END_OF_TURN
    resp = chatml.encode("dcba", add_special_tokens=False)
    eos = chatml.eos_token_id
    assert render_response(chatml, "abcd", "dcba", None, True) == [*resp, 5, eos]
    assert render_response(chatml, "abcd", "dcba", None, False) == [*resp, eos]
    bundled = AutoTokenizer.from_pretrained(tiny_dir)
    assert render_response(bundled, "abcd", "dcba", None, True) == [*resp, eos]
    sft = tokenize_sft(chatml, "abcd", "dcba", 64, apply_chat_template=True)
    n = len(render_prompt(chatml, "abcd", None, True))
    assert sft["input_ids"][n:] == [*resp, 5, eos] and sum(sft["loss_mask"]) == len(resp) + 2
    pair = tokenize_pair(chatml, "abcd", "dcba", "1234", 64, apply_chat_template=True)
    assert pair["chosen_ids"][n:] == [*resp, 5, eos]
    cut = tokenize_pair(chatml, "abcd", "dcba", "1234", n + 2, apply_chat_template=True)
    assert cut["chosen_ids"][n:] == [resp[0], eos]  # the reward is still read at an EOS
    # a template whose answer does not start with its generation prompt (a thinking prefix in
    # the prompt only): the plain response + EOS, with a warning
    chatml.chat_template = END_OF_TURN.replace(
        "generation_prompt %}<|assistant|>", "generation_prompt %}<|assistant|><|pad|>"
    )
    with pytest.warns(UserWarning, match="does not render an answer after its own generation"):
        sft = tokenize_sft(chatml, "abcd", "dcba", 64, apply_chat_template=True)
    n = len(render_prompt(chatml, "abcd", None, True))
    assert sft["input_ids"][n - 1] == 2 and sft["input_ids"][n:] == [*resp, eos]
    # a template that fails on the answer (not on the prompt) says so
    chatml.chat_template = END_OF_TURN.replace(
        "<|system|>\n{% endif %}", "{{ raise_exception('no answers') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="fails on the answer to 'abcd' .*no answers"):
        tokenize_sft(chatml, "abcd", "dcba", 64, apply_chat_template=True)


def test_tokenize_sft_when_pad_is_eos(tiny_dir):
    same = AutoTokenizer.from_pretrained(tiny_dir, pad_token="<|eos|>")
    assert same.pad_token_id == same.eos_token_id == 1
    out = tokenize_sft(same, "upper: abc", "ABC", 64)
    assert out["input_ids"][-1] == 1 and out["loss_mask"][-1] == 1
    assert out["input_ids"].count(1) == 1


def test_tokenize_sft_truncation(tok):
    n = len(tok.encode("last word: " + "a b c " * 10))
    full = tokenize_sft(tok, "last word: " + "a b c " * 10, "hello world", 512)
    cut = tokenize_sft(tok, "last word: " + "a b c " * 10, "hello world", n + 1)
    assert cut["input_ids"] == full["input_ids"][: n + 1] and sum(cut["loss_mask"]) == 1
    assert len(cut["loss_mask"]) == n + 1
    assert tokenize_sft(tok, "last word: " + "a b c " * 10, "x", n) is None
    with pytest.raises(ValueError, match="max_len"):
        tokenize_sft(tok, "p", "r", 0)


def test_tokenize_pair(tok):
    out = tokenize_pair(tok, "reverse: abcd", "dcba", "1234", 64)
    p = tok.encode("reverse: abcd")
    for key, resp in (("chosen_ids", "dcba"), ("rejected_ids", "1234")):
        assert out[key] == p + tok.encode(resp, add_special_tokens=False) + [tok.eos_token_id]
    n = len(p)
    cut = tokenize_pair(tok, "reverse: abcd", "dcba dcba dcba", "1234 1234 1234", n + 2)
    assert [len(v) for v in cut.values()] == [n + 2, n + 2]
    assert all(v[-1] == tok.eos_token_id and v[:n] == p for v in cut.values())
    assert cut["chosen_ids"][n] != cut["rejected_ids"][n]
    assert tokenize_pair(tok, "reverse: abcd", "dcba", "1234", n + 1) is None


# ---------------------------------------------------------------- bundled data


def test_bundled_files():
    expect = {
        "sft_toy.jsonl": (2000, ["prompt", "response"]),
        "preference_toy.jsonl": (2000, ["prompt", "chosen", "rejected", "margin"]),
        "prompts_toy.jsonl": (1000, ["prompt", "target"]),
    }
    for name, (n, keys) in expect.items():
        path = Path(make_default_path(name))
        assert path.is_absolute() and path.stat().st_size < 300_000
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == n and all(list(r) == keys for r in rows)
    prefs = load_mixture(make_default_path("preference_toy.jsonl"), None, "train", 0, None)
    assert all(c != r for c, r in zip(prefs["chosen"], prefs["rejected"]))
    assert all(m > 0 for m in prefs["margin"])
    with pytest.raises(FileNotFoundError, match="sft_toy.jsonl"):
        make_default_path("nope.jsonl")


def test_bundled_files_match_generator(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_toy_data", data.DATA_DIR / "make_toy_data.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0
    assert mod.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "sft_toy.jsonl").read_bytes() == Path(
        make_default_path("sft_toy.jsonl")
    ).read_bytes()


# ---------------------------------------------------------------- values, templates, rewards
def test_check_values_names_flag_column_and_row():
    ds = datasets.Dataset.from_list(
        [{"p": "a", "r": "x", "m": 1.0}, {"p": "b", "r": None, "m": None}]
    )
    with pytest.raises(ValueError, match=r"--output-key 'r': row 1 \(0-based\) of the data"):
        data.check_values(ds, {"--input-key": "p", "--output-key": "r"}, "data")
    with pytest.raises(ValueError, match="--margin-key 'm': row 1.*expected a finite number"):
        data.check_values(ds, {"--margin-key": "m"}, "data")
    for bad in (float("nan"), float("inf")):  # one NaN margin used to make every weight NaN
        nan = datasets.Dataset.from_list([{"m": 1.0}, {"m": bad}])
        with pytest.raises(ValueError, match="--margin-key 'm': row 1.*expected a finite number"):
            data.check_values(nan, {"--margin-key": "m"}, "data")
    digits = datasets.Dataset.from_list([{"p": "q", "r": 42}])  # a CSV of digits: int64
    data.check_values(digits, {"--input-key": "p", "--output-key": "r"}, "data")


def test_chat_message_prompts(tok):
    """A column of chat messages was rendered as its Python repr; now it is the conversation
    (with --apply-chat-template) or a clear error."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abcd"}]
    ds = datasets.Dataset.from_list([{"p": msgs, "r": "dcba"}])
    keys = {"--input-key": "p", "--output-key": "r"}
    data.check_values(ds, keys, "data", chat_flag="--input-key")
    with pytest.raises(ValueError, match="--input-key 'p': row 0.*--apply-chat-template only"):
        data.check_values(ds, keys, "data")
    ids = render_prompt(tok, ds[0]["p"], None, True)
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids) == want and "[{" not in want
    with pytest.raises(ValueError, match="needs --apply-chat-template"):
        render_prompt(tok, msgs, None, False)
    # content must be text (None rendered as an empty turn)
    empty = datasets.Dataset.from_list([{"p": [{"role": "user", "content": None}], "r": "x"}])
    with pytest.raises(ValueError, match="--input-key 'p': row 0"):
        data.check_values(empty, keys, "data", chat_flag="--input-key")
    # a message the template refuses is a ValueError naming the prompt, not a jinja traceback
    bad = [{"role": "tool", "content": "abcd"}]
    try:
        tok.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
    except Exception as e:
        assert not isinstance(e, ValueError)
        with pytest.raises(ValueError, match="chat template fails on the prompt"):
            render_prompt(tok, bad, None, True)
    else:
        pytest.skip("the tiny template accepts a tool turn")


@pytest.mark.parametrize(
    "template,match",
    [("Q: {{}} A:", "has no '{}'"), ('{"question": "{}"} answer:', "str.format fails")],
)
def test_input_template_checked(template, match):
    data.check_template("Q: {} A:")
    data.check_template('{{"question": "{}"}} answer:')  # literal braces doubled
    with pytest.raises(ValueError, match=match):
        data.check_template(template, "--input-template")
    with pytest.warns(UserWarning, match=r"literal backslash-n, not a newline: in bash write \$"):
        data.check_template("Q: {}\\nA: ")  # what 'Q: {}\nA: ' in a shell gives


def test_a_literal_backslash_n_template_warns_once(tok):
    """The flags' check warns; rendering every prompt with that template does not warn again
    (it warned a second time from the data path, once per rank)."""
    import warnings

    from trainers.sft import SFTConfig

    template = "Q: {}\\nA: "
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        SFTConfig(input_template=template).validate()
        for prompt in ("ab", "cd"):
            assert render_prompt(tok, prompt, template, False) == tok.encode(
                template.format(prompt)
            )
    assert [str(w.message).count("literal backslash-n") for w in seen] == [1]


def test_reward_positions_follow_transformers():
    """The last token that is not pad: with pad == EOS the token before a final EOS, as
    AutoModelForSequenceClassification reads a saved reward model."""
    from trainers.common import reward_positions

    seqs = [
        torch.tensor([5, 6, 1]),
        torch.tensor([5, 1, 1]),
        torch.tensor([1, 1]),
        torch.tensor([7]),
    ]
    assert reward_positions(seqs, pad_id=0) == [2, 2, 1, 0]
    assert reward_positions(seqs, pad_id=1) == [1, 0, 1, 0]
    assert reward_positions(seqs, pad_id=None) == [2, 2, 1, 0]


def test_csv_columns_are_text(tmp_path):
    """CSV has no types: digits stay the text they were ("0007" used to train on "7"), and a
    margin column of number text is read as numbers."""
    f = tmp_path / "pairs.csv"
    f.write_text("prompt,chosen,rejected,margin\ncount,0007,0008,1.5\nnext,12,13,-2\n")
    ds = load_mixture(str(f), None, "train", 0, None)
    assert ds["chosen"] == ["0007", "12"] and ds["margin"] == ["1.5", "-2"]
    data.check_values(ds, {"--chosen-key": "chosen", "--margin-key": "margin"}, "data")
    excel = tmp_path / "excel.csv"  # Excel's "CSV UTF-8" starts with a byte-order mark
    excel.write_text("prompt,chosen\nq,0007\n", encoding="utf-8-sig")
    assert load_mixture(str(excel), None, "train", 0, None)["chosen"] == ["0007"]
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,margin\na,1\nb,nan\n")
    with pytest.raises(ValueError, match="--margin-key 'margin': row 1.*finite number"):
        data.check_values(
            load_mixture(str(bad), None, "train", 0, None), {"--margin-key": "margin"}, "d"
        )
