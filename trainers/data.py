"""Dataset loading, mixing, holdout and tokenisation shared by the trainers.

Token rows are plain ``list[int]``; ``loss_mask`` has the length of ``input_ids`` with 1 on the
tokens the loss is taken on (response and EOS). Every sample ends in ``tokenizer.eos_token_id``
unless truncation cut it off (SFT only; pairs always keep it so a reward is read at EOS).
"""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import datasets
import pandas
from datasets.exceptions import DatasetGenerationError

from rlhf_kernels._checks import is_real

DATA_DIR = Path(__file__).resolve().parent / "data"
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_DROPPED = "load_mixture dropped columns not shared by every dataset: "
_JSON = getattr(datasets, "Json", ())  # datasets >= 5: a column of mixed types (5 and "five")


def make_default_path(name: str) -> str:
    """Absolute path of a bundled file in ``trainers/data``, e.g. ``"sft_toy.jsonl"``."""
    path = DATA_DIR / name
    if not path.is_file():
        have = sorted(p.name for p in DATA_DIR.iterdir() if p.is_file())
        raise FileNotFoundError(f"name {name!r}: expected one of {have}, got no such file")
    return str(path)


def _load_one(item: str, split: str) -> datasets.Dataset:
    path = Path(item).expanduser()
    if path.is_dir():
        index = path / "dataset_dict.json"
        if index.is_file():  # a DatasetDict: load the one split (another may be unloadable)
            splits = json.loads(index.read_text()).get("splits", [])
            if split not in splits:
                raise ValueError(f"split {split!r} of dataset {item!r}: expected one of {splits}")
            path = path / split
        elif split != "train" and (path / "dataset_info.json").is_file():  # one Dataset
            raise ValueError(f"split {split!r} of dataset {item!r}: expected one of ['train']")
        try:
            return datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise ValueError(
                f"dataset {item!r}: expected a folder written by save_to_disk, got a folder "
                "without its dataset_info.json / dataset_dict.json"
            ) from None
        except IndexError:  # datasets cannot read back a saved split of 0 rows
            raise ValueError(f"dataset {item!r}: split {split!r} holds no rows") from None
    elif path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"dataset {item!r}: expected a file ending in {sorted(_BUILDERS)} or a folder "
                f"from save_to_disk, got suffix {path.suffix!r}"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"dataset {item!r}: the file is empty (no rows)")
        kwargs = {}
        if builder == "csv":  # CSV has no types: every column is text ("0007" stays "0007",
            # "NA" / "None" stay text: only an empty cell is missing)
            kwargs = {"keep_default_na": False, "na_values": [""]}
            try:  # the names pandas gives ('Unnamed: 0' for to_csv's index, 'a.1' for a 2nd 'a')
                header = pandas.read_csv(path, nrows=0, encoding="utf-8").columns
            except (ValueError, UnicodeError) as e:  # EmptyDataError, ParserError
                raise ValueError(f"dataset {item!r}: cannot be read as csv: {e}") from None
            kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in header})
        try:
            loaded = datasets.load_dataset(builder, data_files=str(path), **kwargs)
        except DatasetGenerationError as e:  # malformed JSON / CSV / parquet
            cause = e.__cause__ or e
            raise ValueError(f"dataset {item!r}: cannot be read as {builder}: {cause}") from None
        except ValueError as e:  # "Instruction 'train' corresponds to no data!", ArrowInvalid
            if "no data" in str(e):
                raise ValueError(f"dataset {item!r}: the file holds no rows") from None
            raise ValueError(f"dataset {item!r}: cannot be read as {builder}: {e}") from None
    else:
        raise FileNotFoundError(f"dataset {item!r}: no such file or folder")
    splits = list(loaded) if isinstance(loaded, datasets.DatasetDict) else ["train"]
    if split not in splits:
        raise ValueError(f"split {split!r} of dataset {item!r}: expected one of {splits}")
    return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded


def _parse_probs(probs: str, n: int) -> list[float]:
    try:
        values = [float(p) for p in probs.split(",")]
    except ValueError:
        raise ValueError(f"probs: expected comma-separated floats, got {probs!r}") from None
    if len(values) != n or any(not (0 < v < math.inf) for v in values):
        raise ValueError(
            f"probs: expected {n} positive finite floats (one per dataset), got {probs!r}"
        )
    top = max(values)  # scaled first: a sum of values near the float limit overflows to inf
    return [v / top / sum(x / top for x in values) for v in values]


def _common_columns(parts: list[datasets.Dataset], names: list[str]) -> list[datasets.Dataset]:
    """Keep only the columns every part has (first part's order), each cast to one type: the
    parts' own when they agree; text when any part has text there, or a JSON column mixing
    text and numbers (numbers become their digits, class labels their names, and text such as
    "0007" is never parsed as a number); int64 / float64 when the parts mix numbers and
    booleans; else the first part's (a failing cast names the part)."""
    common = [c for c in parts[0].column_names if all(c in p.column_names for p in parts)]
    dropped = sorted({c for p in parts for c in p.column_names} - set(common))
    if not common:
        raise ValueError(
            f"dataset: expected datasets sharing at least one column, got columns "
            f"{[p.column_names for p in parts]}"
        )
    parts = [p.select_columns(common) for p in parts]
    features = parts[0].features.copy()
    for c in common:
        kinds = [p.features[c] for p in parts]
        if any(k != kinds[0] for k in kinds):
            features[c] = _joint_type(kinds)
    parts = [_label_names(p, features) for p in parts]
    parts = _cast_all(parts, features, names)
    if dropped:
        for p in parts:
            p.info.description = f"{p.info.description or ''}\n{_DROPPED}{dropped}".lstrip("\n")
    return parts


def _label_names(part: datasets.Dataset, features) -> datasets.Dataset:
    """``ClassLabel`` columns that become text hold their label names, not the label numbers;
    ``Json`` ones (a JSON column of text and numbers) their values' text: a cast gave the JSON
    (``"five"`` with its quotes)."""
    for c, f in part.features.items():
        if features[c] != datasets.Value("string"):
            continue
        if isinstance(f, datasets.ClassLabel):  # -1 / None: a missing label (datasets' way)
            text = lambda x, names=f.names: None if x is None or x < 0 else names[x]  # noqa: E731
        elif isinstance(f, _JSON):
            text = lambda x: x if x is None or isinstance(x, str) else json.dumps(x)  # noqa: E731
        else:
            continue
        feats = part.features.copy()
        feats[c] = datasets.Value("string")
        part = part.map(
            lambda b, c=c, text=text: {c: [text(x) for x in b[c]]}, batched=True, features=feats
        )
    return part


def _joint_type(kinds: list) -> object:
    """One ``datasets`` feature for a column the parts type differently (see _common_columns)."""
    dtypes = [k.dtype if isinstance(k, datasets.Value) else None for k in kinds]
    if any(d in ("string", "large_string") for d in dtypes):
        return datasets.Value("string")
    if any(isinstance(k, _JSON) for k in kinds) and all(  # Json: text and numbers
        isinstance(k, _JSON) or d is not None for k, d in zip(kinds, dtypes)
    ):
        return datasets.Value("string")
    if all(isinstance(k, datasets.ClassLabel) for k in kinds):  # other names: a cast by number
        return datasets.Value("string")  # would swap labels; their names agree
    if all(
        d is not None and (d == "bool" or d.startswith(("int", "uint", "float"))) for d in dtypes
    ):
        return datasets.Value("float64" if any(d.startswith("float") for d in dtypes) else "int64")
    return kinds[0]


def _cast_all(parts, features, names: list[str]) -> list[datasets.Dataset]:
    out = []
    for p, name in zip(parts, names):
        try:
            out.append(p if p.features == features else p.cast(features))
        except (ValueError, TypeError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(
                f"dataset {name!r}: cannot be mixed with {names[0]!r}: its column types "
                f"{dict(p.features)} do not convert to {dict(features)} ({e})"
            ) from None
    return out


def load_mixture(
    dataset: str, probs: str | None, split: str, seed: int, max_samples: int | None
) -> datasets.Dataset:
    """Load a comma-separated list of files/save_to_disk folders and mix them into one Dataset.

    Plain files have a single split, ``"train"``. Several datasets: with ``probs`` they are
    interleaved (seeded, until every one is exhausted), without they are concatenated in order.
    Only the columns common to all are kept. ``max_samples`` keeps the first N after mixing.
    """
    items = [s.strip() for s in dataset.split(",") if s.strip()]
    if not items:
        raise ValueError(f"dataset: expected comma-separated files or folders, got {dataset!r}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples: expected a positive int or None, got {max_samples!r}")
    weights = _parse_probs(probs, len(items)) if probs is not None else None
    parts = [_load_one(item, split) for item in items]
    if len(parts) == 1:
        mixed = parts[0]
    else:
        parts = _common_columns(parts, items)
        if weights is None:
            mixed = datasets.concatenate_datasets(parts)
        else:
            mixed = datasets.interleave_datasets(
                parts, probabilities=weights, seed=seed, stopping_strategy="all_exhausted"
            )
        mixed.info.description = parts[0].info.description
    if max_samples is not None and max_samples < len(mixed):
        mixed = mixed.select(range(max_samples))
    return mixed


def split_train_eval(
    train: datasets.Dataset,
    eval_ds: datasets.Dataset | None,
    eval_ratio: float,
    seed: int,
    columns: Sequence[str] | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """``(train, eval)``: ``eval_ds`` as given, else a seeded ``eval_ratio`` holdout of ``train``.

    The holdout has at least 1 row; both keep their original row order and never overlap, in
    content too: a training row equal to a held-out one (a row that ``--dataset-probs`` mixing
    repeats, or a duplicate in the data) is dropped from training. Rows are compared on
    ``columns`` (the ones the trainer reads; default all), so an ``id`` column does not hide a
    duplicate. ``eval_ratio == 0`` and no ``eval_ds`` gives ``(train, None)``.
    """
    if not 0 <= eval_ratio < 1:
        raise ValueError(f"eval_ratio: expected a float in [0, 1), got {eval_ratio!r}")
    if eval_ds is not None or eval_ratio == 0:
        return train, eval_ds
    n = len(train)
    if n < 2:
        raise ValueError(f"eval_ratio: holding out needs at least 2 training rows, got {n}")
    n_eval = min(max(1, round(n * eval_ratio)), n - 1)
    held = set(random.Random(seed).sample(range(n), n_eval))
    cols = train.column_names if columns is None else list(columns)
    view = train.select_columns(cols)
    rows = [json.dumps(row, sort_keys=True, default=str) for row in view]
    seen = {rows[i] for i in held}
    keep = [i for i in range(n) if i not in held and rows[i] not in seen]
    if not keep:
        raise ValueError(
            f"eval_ratio: every training row equals a held-out row ({n} rows, "
            f"{len(seen)} distinct); lower --eval-ratio or give --eval-dataset"
        )
    return train.select(keep), train.select(sorted(held))


def check_keys(ds: datasets.Dataset, keys: dict[str, str | None], what: str) -> None:
    """Raise ValueError naming the flag if a column in ``keys`` (flag -> column) is missing."""
    for flag, column in keys.items():
        if column is not None and column not in ds.column_names:
            msg = f"{flag} {column!r} is not a column of the {what}; columns: {ds.column_names}"
            notes = [ln for ln in (ds.info.description or "").splitlines() if _DROPPED in ln]
            raise ValueError(msg + (f" ({notes[-1]})" if notes else ""))


def check_template(
    input_template: str | None, flag: str = "input_template", warn: bool = True
) -> None:
    """ValueError unless ``input_template.format(prompt)`` works and shows the whole prompt (a
    ``{{}}`` is a literal ``{}`` for ``str.format``; write literal braces as ``{{`` ``}}``).
    ``warn``: also warn about a literal backslash-n (once, where the flags are checked)."""
    if input_template is None:
        return
    a, b = "PROMPT_a_7f3e", "PROMPT_b_7f3e"
    try:  # the prompt is placed when it shows in the result (a literal NUL is no placeholder;
        # '{.upper}' shows a method, '{[0]}' one character)
        shown = input_template.format(a)
        placed = a in shown and shown != input_template.format(b)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(
            f"{flag} {input_template!r}: str.format fails on it ({type(e).__name__}: {e}); "
            "literal braces are written {{ and }}"
        ) from None
    if not placed:
        raise ValueError(
            f"{flag} {input_template!r} has no '{{}}' where the prompt goes ('{{{{}}}}' is a "
            "literal '{}')"
        )
    if warn and "\\n" in input_template:  # 'Q: {}\nA: ' in a shell: a backslash and an n
        warnings.warn(
            f"{flag} {input_template!r} holds a literal backslash-n, not a newline: in bash "
            f"write $'Q: {{}}\\nA: ' (or \"Q: {{}}\\nA: \" in a YAML --config) for a newline",
            stacklevel=2,
        )


def is_chat(value) -> bool:
    """A list of chat messages (``{"role": ..., "content": ...}`` dicts, text content)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, Mapping)
            and {"role", "content"} <= m.keys()
            and isinstance(m["content"], str)
            for m in value
        )
    )


def check_values(
    ds: datasets.Dataset, keys: dict[str, str | None], what: str, chat_flag: str | None = None
) -> None:
    """ValueError naming the flag, column and 0-based row of the first value that is not text
    (None, a float, a list...): integers are fine (read as their digits), ``--margin-key``
    takes numbers, and the ``chat_flag`` column may hold chat messages (with
    ``--apply-chat-template``)."""
    for flag, column in keys.items():
        if column is None:
            continue
        for i, value in enumerate(ds[column]):
            if flag == "--margin-key":  # NaN would turn every weight into NaN
                ok = _finite_number(value)
                want = "a finite number"
            else:
                ok = isinstance(value, (str, int)) and not isinstance(value, bool)
                ok = ok or (flag == chat_flag and is_chat(value))
                want = "text" + (" or a list of chat messages" if flag == chat_flag else "")
            if not ok:
                shown = repr(value)[:60]
                hint = ""
                if is_chat(value) and flag != chat_flag:
                    hint = (
                        " (chat messages are read from the prompt column with "
                        "--apply-chat-template only)"
                    )
                raise ValueError(
                    f"{flag} {column!r}: row {i} (0-based) of the {what} holds "
                    f"{type(value).__name__} {shown}, expected {want}{hint}"
                )


def _finite_number(value) -> bool:
    """An int/float, or number text (a CSV column), that is finite."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return is_real(value, finite=True)


def render_prompt(
    tokenizer, text, input_template: str | None, apply_chat_template: bool
) -> list[int]:
    """Prompt token ids: ``input_template.format(text)``, then a one-turn chat with a generation
    prompt if ``apply_chat_template`` (specials come from the template), else ``encode`` (which
    adds BOS if the tokenizer does). ``text`` may be a list of chat messages (with
    ``apply_chat_template``, no template): the conversation so far, answered next; an integer
    is read as its digits."""
    messages = _prompt_messages(text, input_template, apply_chat_template)
    if isinstance(messages, str):
        return list(tokenizer.encode(messages))
    out = _chat(tokenizer, messages, f"the prompt {str(text)[:60]!r}", add_generation_prompt=True,
                tokenize=True)  # fmt: skip
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers >= 5: BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


def render_response(
    tokenizer, prompt, response, input_template: str | None, apply_chat_template: bool
) -> list[int]:
    """Response token ids ending in one EOS: the response's tokens, or with
    ``apply_chat_template`` the template's assistant turn after the generation prompt (its
    end-of-turn marker included, trailing whitespace dropped), then EOS unless it ends so. A
    template whose answer does not start with its generation prompt (one that adds a thinking
    prefix to the prompt only) gets the plain response + EOS, with a warning."""
    eos = _eos_id(tokenizer)
    messages = _prompt_messages(prompt, input_template, apply_chat_template)
    text = str(response)
    if not isinstance(messages, str):
        where = f"the prompt {str(prompt)[:60]!r}"
        head = _chat(tokenizer, messages, where, add_generation_prompt=True, tokenize=False)
        turn = [*messages, {"role": "assistant", "content": text}]
        full = _chat(tokenizer, turn, f"the answer to {str(prompt)[:60]!r}", tokenize=False)
        if full.startswith(head):
            text = full[len(head) :].rstrip()
        else:  # e.g. DeepSeek-R1 distills: '<think>\n' only in the generation prompt
            warnings.warn(
                "--apply-chat-template: the tokenizer's chat template does not render an answer "
                "after its own generation prompt, so responses are trained as their text + EOS "
                "(without the template's end-of-turn marker)",
                stacklevel=2,
            )
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    return ids if ids and ids[-1] == eos else [*ids, eos]


def _prompt_messages(text, input_template: str | None, apply_chat_template: bool):
    """The prompt as chat messages, or as text when no chat template applies."""
    if is_chat(text):
        if not apply_chat_template or input_template is not None:
            raise ValueError(
                "a prompt of chat messages needs --apply-chat-template and no --input-template"
            )
        return [dict(m) for m in text]
    text = str(text) if isinstance(text, int) and not isinstance(text, bool) else text
    if not isinstance(text, str):
        raise ValueError(f"prompt: expected text, got {type(text).__name__} {text!r:.60}")
    check_template(input_template, warn=False)  # the flags' check warned already
    if input_template is not None:
        text = input_template.format(text)
    return [{"role": "user", "content": text}] if apply_chat_template else text


def _chat(tokenizer, messages, where: str, **kwargs):
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("apply_chat_template: expected a tokenizer with a chat_template, got none")
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # jinja2's TemplateError (a role the template refuses...)
        raise ValueError(
            f"--apply-chat-template: the tokenizer's chat template fails on {where} "
            f"({type(e).__name__}: {e})"
        ) from None


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer: expected an eos_token_id, got None")
    return int(eos)


def _check_max_len(max_len: int, least: int) -> None:
    if max_len < least:
        raise ValueError(f"max_len: expected an int >= {least}, got {max_len!r}")


def tokenize_sft(
    tokenizer,
    prompt: str,
    response: str,
    max_len: int,
    input_template: str | None = None,
    apply_chat_template: bool = False,
) -> dict[str, list[int]] | None:
    """``{"input_ids": prompt + response + [eos], "loss_mask": 0s then 1s}``, both <= max_len
    (with a chat template the response is its assistant turn: :func:`render_response`).

    Truncation keeps the start (so a long response may lose its EOS). Returns None when the
    prompt alone fills ``max_len`` (no response token would be trained): callers count drops.
    """
    _check_max_len(max_len, 1)
    prompt_ids = render_prompt(tokenizer, prompt, input_template, apply_chat_template)
    if len(prompt_ids) >= max_len:
        return None
    answer = render_response(tokenizer, prompt, response, input_template, apply_chat_template)
    ids = (prompt_ids + answer)[:max_len]
    mask = ([0] * len(prompt_ids) + [1] * len(answer))[:max_len]
    return {"input_ids": ids, "loss_mask": mask}


def tokenize_pair(
    tokenizer,
    prompt: str,
    chosen: str,
    rejected: str,
    max_len: int,
    input_template: str | None = None,
    apply_chat_template: bool = False,
) -> dict[str, list[int]] | None:
    """``{"chosen_ids", "rejected_ids"}``: prompt + response (:func:`render_response` less its
    EOS), cut to ``max_len - 1``, + [eos].

    The last token is always EOS (the reward is read there). Returns None when the prompt leaves
    no room for one response token and the EOS (``len(prompt_ids) + 2 > max_len``).
    """
    _check_max_len(max_len, 2)
    prompt_ids = render_prompt(tokenizer, prompt, input_template, apply_chat_template)
    if len(prompt_ids) + 2 > max_len:
        return None
    eos = _eos_id(tokenizer)

    def seq(response: str) -> list[int]:
        answer = render_response(tokenizer, prompt, response, input_template, apply_chat_template)
        return (prompt_ids + answer[:-1])[: max_len - 1] + [eos]

    return {"chosen_ids": seq(chosen), "rejected_ids": seq(rejected)}
