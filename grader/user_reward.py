"""Your own reward function (docs/paper.md §1 and "Deliberate differences": D15;
docs/training.md#your-own-data-reward-and-recipe): --reward FILE.py:FUNCTION or MODULE:FUNCTION,
loaded once and checked (`load_function`), called on a response or a batch with the row's fields it
takes by keyword (`call`); whatever it does wrong is one line naming it (`RewardError`). reward.py's
`reward` and `rewards` call it in place of the built-in modes.
"""
import copy
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import traceback

from command_line.errors import InputError

# Any verifier can be the reward (code that runs tests, a format check, another grader), as TRL's
# reward functions are: --reward FILE.py:FUNCTION or MODULE:FUNCTION names a Python function
#     def FUNCTION(response: str, answer: str | list[str], prompt=None, **row) -> float
# called once per sampled response with the row's gold (--answer-key: a string or a list of them) in
# train.py (training, held-out evaluation) and eval.py. After (response, answer) it may take by
# keyword row fields (`units=None`, or all as **row) and `prompt`, the problem as --prompt-key gave
# it (no instruction); a parameter without a default is a field every row must have. Declared
# batched (`FUNCTION.batched = True`), it gets lists once per step (eval.py: per generate call) of
# responses, answers and each keyword (None where a row lacks it) and returns as many numbers.
# Rewards are finite numbers (a bool: 1 / 0) of any scale (advantages are group-normalized),
# positive exactly for a correct response (reward/acc, held-out accuracy and avg@k count positive
# rewards). examples/: reward_last_line.py (two arguments), reward_with_row.py (fields, batched).
BUILTIN = ("dapo", "binary", "strict")
OWN = ("response", "answer")  # passed first: row fields of these names are not passed again


class RewardError(InputError):
    """Your reward function raised, or returned something other than a finite number."""


@functools.lru_cache(maxsize=None)
def load_function(spec):
    """Your function that `spec` names, checked: "FILE.py:FUNCTION" (a Python file, path relative to
    the working directory) or "MODULE:FUNCTION" (an importable module); reward.load_reward takes the
    built-in modes. A spec of neither form, a missing file or module, an error while importing it,
    a missing or non-callable FUNCTION, or one that cannot be called with (response, answer) and its
    keywords raises ValueError in one line. Loaded once per process."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"unknown reward {spec!r}; valid: {', '.join(BUILTIN)}, or your own as "
                         f"FILE.py:FUNCTION or MODULE:FUNCTION")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ValueError(f"reward {spec}: no such file {where}")
            module_spec = importlib.util.spec_from_file_location(
                f"_reward_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises while it is imported
        raise ValueError(f"reward {spec}: importing {where} raised {type(e).__name__}: "
                         f"{_first_line(e)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec}: {where} has no function {name}")
    try:
        inspect.signature(fn).bind("response", "answer", **dict.fromkeys(_takes(fn)[1]))
    except TypeError:
        raise ValueError(f"reward {spec}: {name} must take two arguments, (response, answer), and "
                         f"then the row's fields by keyword") from None
    except ValueError:  # no signature to inspect (some builtins): the first call will tell
        pass
    return fn


@functools.lru_cache(maxsize=None)
def _takes(fn):
    """(the row fields fn takes by keyword after (response, answer): their names, or None for all of
    them (**row); those without a default, which every row must have)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return (), ()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    every = any(p.kind is p.VAR_KEYWORD for p in params)
    return (None if every else tuple(p.name for p in named)), \
        tuple(p.name for p in named if p.default is p.empty)


def _keywords(fn, spec, rows, batched):
    """The keywords of fn's call for these rows (one, or a batch's lists): `prompt` (the problem)
    and the row's fields that fn takes (`_takes`); a field it needs that a row lacks is a
    RewardError naming it."""
    names, needed = _takes(fn)
    if names == ():
        return {}
    fields = [{} if row is None else
              {**{k: v for k, v in row.get("fields", {}).items() if k not in OWN},
               "prompt": row["problem"]} for row in rows]
    for f in fields:
        missing = [n for n in needed if n not in f]
        if missing:
            raise RewardError(f"reward function {spec} takes {missing[0]!r}, a field this row "
                              f"lacks (its fields: {', '.join(f) or 'none'}); give it a default")
    keys = [k for k in dict.fromkeys(k for f in fields for k in f) if names is None or k in names]
    return {k: [f.get(k) for f in fields] for k in keys} if batched else \
        {k: fields[0][k] for k in keys}


def call(fn, spec, responses, golds, rows):
    """fn's rewards of the responses (lists; one call with lists if fn is batched, else fn(response,
    gold, **fields) for the one response) as floats; anything it raises (SystemExit from
    sys.exit included; Ctrl-C's KeyboardInterrupt passes), or a value that is not a finite number,
    is a RewardError naming the function (and, for an exception, the file:line that raised it). It
    gets copies of the golds and the row's fields: what it changes in them stays with it."""
    batched = getattr(fn, "batched", False)
    keywords, golds = copy.deepcopy((_keywords(fn, spec, rows, batched), list(golds)))
    try:
        values = fn(list(responses), golds, **keywords) if batched else \
            [fn(responses[0], golds[0], **keywords)]
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - user code: anything -> a line naming it and where
        at = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where it was raised
        did = (f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else
               f"raised {type(e).__name__}")
        raise RewardError(f"reward function {spec} {did} at {at.filename}:{at.lineno}"
                          + ("" if isinstance(e, SystemExit) else f": {_first_line(e)}")) from e
    if batched and (isinstance(values, (str, bytes)) or not hasattr(values, "__len__")):
        raise RewardError(f"reward function {spec} returned {_shown(values)}, not a list of "
                          f"{len(responses)} numbers (it is batched: one per response)")
    if batched and len(values) != len(responses):
        raise RewardError(f"reward function {spec} returned {len(values)} "
                          f"value{'s' * (len(values) != 1)} for {len(responses)} responses (it is "
                          f"batched: one number per response)")
    for value in values:
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward function {spec} returned {_shown(value)}, not a finite "
                              f"number")
    return [float(v) for v in values]


def _shown(value, width=60):
    """A value as an error line shows it: its repr, cut to `width` characters with '...'."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
