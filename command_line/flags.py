"""The command line and config files of train.py, eval.py and counterfactual: one --flag per field
of a dataclass (its docstring is the --help), `--config FILE` as a base layer, values from a file
checked against the fields, and a parser whose every error is one line with a "did you mean".

    given = parse_flags(Config, argv,
                        "train.py")  # {field: value} of the flags given (and of --config FILE)
    values = check_values(Config, recorded,
                          "runs/x/config.json")  # a file's values checked against the fields
"""
from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Callable, Literal

from data import TOO_DEEP, describe, parse_json


class OneLineParser(argparse.ArgumentParser):
    """One error line instead of the usage block, a flag close to a misspelled or shortened one
    named ("did you mean"), and no abbreviations: `--ste 3` is refused, never taken
    for `--steps 3`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            given = [a.split("=")[0]
                     for a in message.removeprefix("unrecognized arguments: ").split()]
            close = [difflib.get_close_matches(a, [f for f in self._option_string_actions
                                                   if f.startswith("--")], n=1, cutoff=0.6)
                     for a in given if a.startswith("--")]
            close = list(dict.fromkeys(c[0] for c in close if c))
            message += f" (did you mean {' or '.join(close)}?)" if close else ""
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_flags(cls, argv: list[str] | None, prog: str, notes: dict[str, str] | None = None,
                modes: dict[str, str] | None = None) -> dict:
    """The flags given in argv, as {field: value}, for the dataclass `cls` (absent flags are absent:
    the caller layers them over its defaults, a preset or a training run's config.json) (D48).

    One --flag per field (underscores -> dashes); its --help is the string literal under the field,
    its default and `notes[field]`. bool -> --flag/--no-flag, list[X] -> one or more X (repeatable:
    --f a --f b gives both), Literal -> choices, X | None -> X or 'none'. `--config FILE` (JSON or
    YAML, e.g. a run's config.json) gives values as if they were flags, under the flags on the
    command line (`read_config`). `modes` ({name: help}) lists options the caller handles before
    parsing (train.py's --plot) in --help. A bad flag or config file prints one line
    `PROG: error: ...` and exits with status 2."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}
    hints = typing.get_type_hints(cls)
    parser = OneLineParser(prog=prog, description=(cls.__doc__ or "").strip(),
                           argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="a JSON or YAML file of flag values, each "
                        "key a flag's name with underscores (--top-p: top_p), e.g. a run's "
                        "config.json: the base layer under the flags given here, which win")
    for f in fields(cls):
        tp = hints[f.name]
        default = f.default_factory() if f.default is MISSING else f.default
        note = f" ({notes[f.name]})" if notes and f.name in notes else ""
        kw = {"help": f"{docs[f.name]} [default: {default!r}{note}]".replace("%", "%%")}
        optional = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        if optional:  # X | None -> X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is list:
            kw.update(nargs="+", type=typing.get_args(tp)[0], action="extend")
        elif typing.get_origin(tp) is Literal:
            kw.update(choices=typing.get_args(tp), type=str)
        else:
            kw["type"] = _or_none(tp) if optional else tp
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    if modes:
        group = parser.add_argument_group("other modes")
        for name, text in modes.items():
            group.add_argument("--" + name, nargs="+", metavar="RUN", help=text.replace("%", "%%"))
    given = vars(parser.parse_args(argv))
    if "config" in given:
        try:
            given = {**read_config(cls, given.pop("config")), **given}
        except ValueError as e:
            parser.error(str(e))
    return given


# config.json's record of the code that wrote it ({"commit", "dirty"}: run_folder.code_version), not
# a flag: --config FILE reads past it, so that `--config OUT/config.json` reruns a run's recipe.
RECORD = "code"


def read_config(cls, path: str) -> dict:
    """The values of a --config FILE for the dataclass `cls`: a JSON object, or a YAML mapping for
    .yaml / .yml (numbers such as 1e-6 are read as numbers, as JSON and YAML 1.2 read them), checked
    by `check_values`. A file that is missing or does not parse raises ValueError in one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot be read "
                         f"({getattr(e, 'strerror', None) or e})") from None
    if path.endswith((".yaml", ".yml")):
        import re

        import yaml

        # YAML 1.1 reads 1e-6 as text (it wants 1.0e-6); JSON and YAML 1.2 do not
        class Loader(yaml.SafeLoader):
            pass
        Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                     re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                     list("-+0123456789."))
        try:
            values = yaml.load(text, Loader=Loader)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path}: not YAML ({' '.join(str(e).split())})") from None
        except RecursionError:
            raise ValueError(f"--config {path}: {TOO_DEEP}") from None
    else:
        values = parse_json(text, f"--config {path}", str, "; a .yaml or .yml file is read as YAML")
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: not a mapping of flag names to values but "
                         f"{describe(values)}")
    return check_values(cls, {k: v for k, v in values.items() if k != RECORD}, path)


def check_values(cls, values: dict, source: str) -> dict:  # D49
    """`values` ({field name: value}, e.g. a config file's or a run's config.json) checked against
    the fields of the dataclass `cls`: every key is a field and every value has the field's type (a
    float field takes an integer, a field of X | None takes null, nothing else converts: "0.001" is
    not a float, true is not a number). Returns them with integers of float fields as floats; the
    first wrong key raises ValueError naming `source` and it."""
    hints, checked = typing.get_type_hints(cls), {}
    for key, value in values.items():
        if key not in hints:
            close = difflib.get_close_matches(str(key), hints, n=1)
            raise ValueError(f"{source}: unknown key {key!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + "; the keys are the flags' names with underscores")
        ok, wanted, value = _typed(hints[key], value)
        if not ok:
            raise ValueError(f"{source}: {key!r} must be {wanted}, not {describe(values[key])}")
        checked[key] = value
    return checked


def _typed(tp, value) -> tuple[bool, str, object]:
    """(whether `value` has the type `tp`, the type in words, the value as the field keeps it)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:  # X | None
        inner = next(a for a in typing.get_args(tp) if a is not type(None))
        ok, wanted, value = (True, "", None) if value is None else _typed(inner, value)
        return ok, f"{wanted} or null", value
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return value in choices, "one of " + ", ".join(map(repr, choices)), value
    if typing.get_origin(tp) is list:
        parts = ([_typed(typing.get_args(tp)[0], v) for v in value] if isinstance(value, list)
                 else [(False, "", 0)])
        wanted = "a list of " \
            f"{_typed(typing.get_args(tp)[0], None)[1].removeprefix('a ').removeprefix('an ')}s"
        return all(ok for ok, _, _ in parts), wanted, [v for _, _, v in parts]
    if tp is bool:
        return isinstance(value, bool), "true or false", value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), "an integer", value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, "a number", float(value) if ok else value
    return isinstance(value, tp), "a string" if tp is str else f"a {tp.__name__}", value


def _or_none(tp: type) -> Callable[[str], object]:
    def convert(text: str):
        return None if text.lower() == "none" else tp(text)

    convert.__name__ = tp.__name__  # argparse names it in "invalid float value: 'x'"
    return convert


# ------------------------------------------------------------------------- train.py's configuration
