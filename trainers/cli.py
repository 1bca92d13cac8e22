"""Command line and YAML for the trainers, generated from one typed dataclass config.

Every field gets a flag ``--field-name`` (underscores become dashes) whose type comes from the
annotation: ``int``, ``float``, ``str``, ``bool`` or ``X | None`` / ``Optional[X]`` of those
(string annotations from ``from __future__ import annotations`` are resolved). Field metadata:

- ``help``: the flag's help; " (default: X)" is appended unless the help already says
  "(default:". ``bool`` fields are a flag and its negation: ``--x/--no-x`` (``--no-x/--x``
  for a field named ``no_x``), so the command line can undo a YAML ``true``.
- ``choices``: allowed values, checked for flags and YAML values alike.
- ``cli``: ``False`` gives the field no flag (it can still be set from YAML).

``--config FILE.yaml`` is a mapping of field names (``max_len`` or ``max-len``) to values,
applied first: flags given on the command line win. YAML values are converted with the flag's
type (PyYAML reads ``1e-4`` as a string; it becomes a float; a text option takes a number as
written: ``input_key: 007`` is '007', not '7'); ``null`` only for ``X | None``,
whose flags also take ``none`` (so a flag can unset a YAML value).

Errors exit with status 2 and one line ``prog: error: ...``: a bad flag value or choice
(argparse), an unknown YAML key (the valid ones are listed) or one given twice, a YAML value
of the wrong type (key, expected type and given value are named), and the ``ValueError`` of the
config's optional ``validate()`` method, called on the resolved config. ``validate()`` can ask
``is_set(cfg, name)`` whether a field was set: given as a flag (even at its default value) or
away from its default (YAML values at the default do not count: a YAML file may be a full dump
such as a run's ``config.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

_SCALARS = (int, float, str, bool)


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, type | None, bool]]:
    """name -> (field, scalar type or None if unsupported, nullable) for every init field."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"cls must be a dataclass type, got {cls!r}")
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, nullable = hints[f.name], False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            nullable = len(args) < len(typing.get_args(tp))
            tp = args[0] if len(args) == 1 else None
        out[f.name] = (f, tp if tp in _SCALARS else None, nullable)
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help(f: dataclasses.Field, tp: type, nullable: bool) -> str:
    text = f.metadata.get("help", "")
    unset = nullable and "none" not in text.lower()  # the user's words, before the default
    if tp is bool and f.default is not True:
        text += " (flag)"
    elif "(default:" not in text:
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        text += f" (default: {default})"
    if unset:
        text += "; 'none' unsets it"
    return text.strip().replace("%", "%%")  # argparse %-formats help strings


def _or_none(tp: type):
    """argparse type for an ``X | None`` flag: 'none' or 'null' -> None (so a flag can unset
    what ``--config`` set)."""

    def parse(text: str | int | float):
        if isinstance(text, str) and text.strip().lower() in ("none", "null"):
            return None
        return tp(text)

    parse.__name__ = tp.__name__  # argparse's message: "invalid int value: 'x'"
    return parse


def _description(cls: type) -> str | None:
    doc = cls.__doc__ or ""
    return None if doc.startswith(cls.__name__ + "(") else doc  # dataclass's generated doc


def build_parser(
    cls: type, prog: str | None = None, description: str | None = None
) -> argparse.ArgumentParser:
    """Parser with one flag per field of dataclass ``cls`` plus ``--config FILE.yaml``.

    Every default is ``argparse.SUPPRESS``: the namespace holds only the flags actually given.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description if description is not None else _description(cls),
        usage="%(prog)s [-h] [--config FILE.yaml] [--option VALUE ...]",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML mapping of option names to values, applied first (flags given here win)",
    )
    for name, (f, tp, nullable) in _fields(cls).items():
        if not f.metadata.get("cli", True):
            continue
        if name == "config":
            raise TypeError(f"{cls.__name__}.config clashes with --config; rename the field")
        if tp is None:
            raise TypeError(
                f"{cls.__name__}.{name}: expected a type in int, float, str, bool or X | None, "
                f"got {f.type!r}; give it metadata={{'cli': False}} or change the type"
            )
        kw: dict[str, Any] = {"help": _help(f, tp, nullable), "dest": name}
        names = [_flag(name)]
        if tp is bool:  # --x and its negation: a flag can undo what --config set
            kw["action"] = _Toggle
            names.append("--" + name[3:].replace("_", "-") if name.startswith("no_") else
                         "--no-" + name.replace("_", "-"))  # fmt: skip
        else:
            kw["type"] = _or_none(tp) if nullable else tp
            if "choices" in f.metadata:  # None passes too where 'none' unsets the field
                kw["choices"] = (*f.metadata["choices"], *([None] if nullable else []))
                shown = [str(c) for c in f.metadata["choices"]] + (["none"] if nullable else [])
                kw["metavar"] = "{" + ",".join(shown) + "}"
        parser.add_argument(*names, **kw)
    return parser


class _Toggle(argparse.Action):
    """A bool flag and its negation: ``--x`` sets True, ``--no-x`` False (``--no-x`` True and
    ``--x`` False for a field named ``no_x``)."""

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def _convert(key: str, value: Any, tp: type, nullable: bool, choices: Any) -> Any:
    """YAML value -> field value with the flag's type; ValueError naming key, expected, given."""
    expected = tp.__name__ + (" or null" if nullable else "")
    if choices is not None:
        expected = f"one of {list(choices)}"
    bad = ValueError(f"config key {key!r}: expected {expected}, got {value!r}")
    if value is None:
        if nullable:
            return None
        raise bad
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
    elif isinstance(value, bool):  # YAML reads yes/no/on/off as booleans
        raise bad
    elif tp is str:
        if not isinstance(value, (str, int, float)):
            raise bad
        value = getattr(value, "text", value)  # a number as written: 007, 1.10, 0x1F
        value = (_or_none(str) if nullable else str)(value)  # 'none' as on the command line
    else:  # int or float: numbers, or strings such as "1e-4" that PyYAML leaves unparsed
        if not isinstance(value, (str, int, float)) or (tp is int and isinstance(value, float)):
            raise bad
        try:
            value = (_or_none(tp) if nullable else tp)(value)  # 'none' as on the command line
        except ValueError:
            raise bad from None
    if choices is not None and value is not None and value not in choices:
        raise bad
    return value


class _Int(int):
    """A YAML int that remembers its text (``007`` for a text option is '007', not '7')."""

    text: str


class _Float(float):
    """A YAML float that remembers its text (``1.10`` for a text option is '1.10')."""

    text: str


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    one silently); its numbers keep their source text."""

    def _with_text(self, node, cls, construct):
        out = cls(construct(self, node))
        out.text = node.value
        return out

    def construct_mapping(self, node, deep=False):
        seen: list = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': keys that a mapping overrides
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep)


_UniqueKeys.add_constructor(
    "tag:yaml.org,2002:int",
    lambda self, node: self._with_text(node, _Int, yaml.SafeLoader.construct_yaml_int),
)
_UniqueKeys.add_constructor(
    "tag:yaml.org,2002:float",
    lambda self, node: self._with_text(node, _Float, yaml.SafeLoader.construct_yaml_float),
)


def _load_yaml(path: str, fields: dict) -> dict[str, Any]:
    """Read ``--config``; ValueError for an unreadable file, unknown keys or bad values."""
    try:
        with open(path) as fh:
            data = yaml.load(fh, Loader=_UniqueKeys)  # yaml.safe_load, refusing twice-given keys
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}".replace("\n", " ")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of names to values, got {data!r}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields or fields[name][1] is None:
            valid = ", ".join(n for n, (_, tp, _) in fields.items() if tp is not None)
            raise ValueError(f"--config {path}: unknown key {key!r}; valid keys: {valid}")
        if name in out:
            raise ValueError(f"--config {path}: key {key!r} is given twice")
        f, tp, nullable = fields[name]
        out[name] = _convert(key, value, tp, nullable, f.metadata.get("choices"))
    return out


def parse_config(
    cls: type[T],
    argv: list[str] | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Fill dataclass ``cls`` from defaults < ``--config`` YAML < flags, then ``validate()``.

    ``argv`` defaults to ``sys.argv[1:]``. Any error exits 2 via ``parser.error``.
    """
    parser = build_parser(cls, prog, description)
    ns = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    fields = _fields(cls)
    values: dict[str, Any] = {}
    try:
        if "config" in ns:
            values.update(_load_yaml(ns.pop("config"), fields))
        values.update(ns)
        cfg = cls(**values)
        object.__setattr__(cfg, _GIVEN, frozenset(ns))
        if callable(getattr(cfg, "validate", None)):
            cfg.validate()
    except ValueError as e:
        parser.error(str(e))
    return cfg


_GIVEN = "_cli_flags"  # attribute: the field names parse_config got as command-line flags


def is_set(cfg: Any, name: str) -> bool:
    """Whether field ``name`` of ``cfg`` differs from its default or was given as a flag to
    ``parse_config`` (even at its default value)."""
    f = {f.name: f for f in dataclasses.fields(cfg)}[name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return name in getattr(cfg, _GIVEN, ()) or getattr(cfg, name) != default


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Every init field of dataclass instance ``cfg`` by name (YAML/JSON-ready for scalar
    fields); the YAML dump of it is a valid ``--config`` file for the same class."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"cfg must be a dataclass instance, got {cfg!r}")
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
