"""The reward (docs/paper.md §1 and §6: the DAPO reward on the last \\boxed{}; §7: rule-based
grading of the benchmarks): read the final answer of a response, decide whether it equals the gold,
and pay +1 or -1; or call your own reward function instead.

`grade(response, gold)` takes the final answer (after </think> only; the last \\boxed{...}, else
"the answer is ..." phrases, a response or last line that is only a value, or a final sentence
stating one value; never "the last number in the text") and decides whether it equals the gold.
`graded_chars` (and, for token ids, `graded_count`) says how much of a response the reward reads: up
to and including its answer. The grader's parts live in grader/: where an answer sits (extraction),
how its text is cleaned (normalize), the math answer parser (model output never reaches eval, exec,
sympify or parse_expr), equality (equivalence) and its budgets (limits).

Deliberate differences 1-5: docs/paper.md, "Deliberate differences", reward.py.
"""
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import time
import traceback


from command_line.errors import InputError
from grader.equivalence import equivalent
from grader.extraction import HEDGE, SPAN, find_boxes, from_boxes, from_conclusion, from_phrase
from grader.limits import TAIL_CHARS, Refused
from grader.normalize import clean_answer, squash
from grader.parser import WORDS, parse_answer

# ------------------------------------------------------------------------------------------- limits
TIMEOUT_S = 1.0  # wall-clock budget of one grade() call


# --------------------------------------------------------------------------------------- public API
def _golds(gold):
    """A gold answer as a list of strings: a list means several answers (OlympiadBench);
    27.0 -> "27.0"; None: none."""
    return [str(g) for g in ([gold] if isinstance(gold, (str, int, float)) else gold or [])]


def extract_answer(response, timeout=TIMEOUT_S):
    """The final answer of a response as a string ('' for an empty box), or None when there is none
    (or no answer could be found within `timeout` seconds)."""
    try:
        return extract_final(response, time.monotonic() + timeout)[0] \
            if isinstance(response, str) else None
    except Refused:
        return None


def grade(response, gold, timeout=TIMEOUT_S):
    """Whether the final answer of `response` equals `gold` (a string, or a list of strings for
    several answers); extraction and comparison together stop within about `timeout` seconds (the
    deadline starts here; measured: at most ~0.15 s later on hostile inputs, docs/grader.md)."""
    deadline = time.monotonic() + timeout
    try:
        answer, text, boxes = extract_final(response, deadline) if isinstance(response, str) \
            else (None, "", [])
    except Refused:
        return False
    golds = _golds(gold)
    if not (answer and answer.strip() and golds):
        return False
    return equivalent(answer, golds, deadline) or answer_parts(text, boxes, golds, deadline)


def reward(response, gold, mode="dapo", row=None):
    """The RL reward. "dapo": +1 / -1 by `grade`; "binary": 1 / 0; "strict": +1 / -1 by the paper's
    rule, a normalized string match of the last \\boxed{} only; "FILE.py:FUNCTION" or
    "MODULE:FUNCTION": your function (`load_reward`), called as FUNCTION(response, gold, **the
    fields of `row` it takes), row = the data row the response answers ({"problem", "fields"},
    data.read_rows). A response is correct when its reward is positive."""
    if ":" in mode:
        return _call(load_reward(mode), mode, [response], [gold], [row])[0]
    if mode == "strict":
        deadline = time.monotonic() + TIMEOUT_S
        try:
            boxes = extract_final(response, deadline)[2] if isinstance(response, str) else []
            box = boxes[-1][2] if boxes else None
            pred = clean_answer(box, deadline)[0] if box else ""
            golds = ", ".join(clean_answer(g, deadline)[0] for g in _golds(gold))
        except Refused:
            return -1.0
        return 1.0 if pred and squash(pred) == squash(golds) else -1.0
    if mode not in BUILTIN:
        raise ValueError(f"unknown reward {mode!r}; valid: {', '.join(BUILTIN)}, or your own as "
                         f"FILE.py:FUNCTION or MODULE:FUNCTION")
    return 1.0 if grade(response, gold) else (0.0 if mode == "binary" else -1.0)


def rewards(responses, golds, mode="dapo", rows=None):
    """`reward` of each response (golds[i], rows[i]: its gold and data row; rows None: none); your
    own function declared batched is called once, with lists (`_call`). train.py's and eval.py's
    call."""
    if ":" not in mode:  # the built-in modes read no row
        return [reward(response, gold, mode) for response, gold in zip(responses, golds)]
    fn, rows = load_reward(mode), [None] * len(responses) if rows is None else list(rows)
    if getattr(fn, "batched", False):
        return _call(fn, mode, list(responses), list(golds), rows)
    return [_call(fn, mode, [response], [gold], [row])[0]
            for response, gold, row in zip(responses, golds, rows)]


def correct(response, gold, mode="dapo", row=None):
    """Whether `response` is correct under the reward `mode`: its reward is positive. train.py's
    reward/acc and held-out accuracy and eval.py's avg@k count this (for dapo and binary it is
    `grade`)."""
    return rewards([response], [gold], mode, [row])[0] > 0


def graded_chars(response, mode="dapo"):
    """How many leading characters of `response` the reward reads, up to and including the answer
    (the rest is text after the graded answer, which the reward cannot see): for the built-in modes,
    the end of the last occurrence of the extracted answer (the whole response when there is none);
    for your own reward function, the `graded_chars(response)` its module defines
    (tasks/chain_sums.py), else the whole response."""
    if ":" in mode:
        own = getattr(load_reward(mode), "__globals__", {}).get("graded_chars")
        return int(own(response)) if callable(own) else len(response)
    answer = extract_answer(response)
    at = response.rfind(answer) if answer else -1
    return len(response) if at < 0 else at + len(answer)


def graded_count(tokenizer, ids: list[int], mode: str) -> int:
    """How many leading tokens of a response (ids; `tokenizer` decodes them) hold the characters the
    reward reads (`graded_chars`): the fewest whose decoded text has them, by bisection on the
    decoded length of the response's prefixes."""
    chars = graded_chars(tokenizer.decode(ids, skip_special_tokens=True), mode)
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars \
            else (mid + 1, hi)
    return lo


# ---------------------------------------------------------------------------------- your own reward
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
def load_reward(spec):
    """The function `spec` names, checked: a built-in mode ("dapo", "binary", "strict": reward
    itself), or "FILE.py:FUNCTION" (a Python file, path relative to the working directory) or
    "MODULE:FUNCTION" (an importable module). A missing file or module, an error while importing it,
    a missing or non-callable FUNCTION, or one that cannot be called with (response, answer) and its
    keywords raises ValueError in one line. Loaded once per process."""
    if spec in BUILTIN:
        return functools.partial(reward, mode=spec)
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


def _call(fn, spec, responses, golds, rows):
    """fn's rewards of the responses (lists; one call with lists if fn is batched, else fn(response,
    gold, **fields) for the one response) as floats; anything it raises, or a value that is not a
    finite number, is a RewardError naming the function (and, for an exception, the file:line that
    raised it)."""
    batched = getattr(fn, "batched", False)
    keywords = _keywords(fn, spec, rows, batched)
    try:
        values = fn(responses, golds, **keywords) if batched else \
            [fn(responses[0], golds[0], **keywords)]
    except Exception as e:  # noqa: BLE001 - user code: any exception -> a line naming it and where
        at = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where it was raised
        raise RewardError(f"reward function {spec} raised {type(e).__name__} at "
                          f"{at.filename}:{at.lineno}: {_first_line(e)}") from e
    if batched and (isinstance(values, (str, bytes)) or not hasattr(values, "__len__")
                    or len(values) != len(responses)):
        raise RewardError(f"reward function {spec} returned {values!r:.60}, not a list of "
                          f"{len(responses)} numbers (it is batched: one per response)")
    for value in values:
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward function {spec} returned {value!r:.60}, not a finite number")
    return [float(v) for v in values]


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


_RETRACT = re.compile(r"\b(?:wait|actually|instead|mistake|wrong|incorrect|error|re-?check|"
                      r"correction|oops)\b", re.I)
# the model's turn ends at a chat-template token: what follows (an invented next turn) is no answer
_TURN_END = re.compile(r"<\|[a-z_]{2,30}\|>|<(?:start|end)_of_turn>|</s>")
_FOREIGN = r"[^\x00-\x7f°²³¹⁰⁴-⁹⁻π√≤≥≠±−×÷∞€£¥]"  # letters of other scripts: prose, not a value
_NOT_UNIT = {"or", "and", "not", "no", "is", "wrong", "maybe", "perhaps", "possibly",
             "approximately", "about"}


def answer_parts(text, boxes, golds, deadline):
    """A gold of k > 1 answers against the last k boxes, one per part
    ("(a) \\boxed{6} ... (b) \\boxed{15}"), when none of them is unterminated, empty or hedged and
    no retraction stands between them."""
    try:
        k = len(golds) if len(golds) > 1 else \
            len(parse_answer(clean_answer(golds[0], deadline)[0], deadline))
    except Exception:  # Refused, or any sympy error: a gold that can't be counted has no parts
        return False
    last = boxes[-k:]
    if not 1 < k <= len(boxes) or any(not (c and c.strip()) or HEDGE.match(text[e : e + 100])
                                      for _, e, c in last):
        return False
    if _RETRACT.search(text[last[0][1] : last[-1][0]]):
        return False  # \boxed{3} ... wait, actually \boxed{5}: the second replaces the first
    joined = text[boxes[-k - 1][1] : last[0][0]] if len(boxes) > k and boxes[-k - 1][1] else ""
    if len(joined) <= 40 and re.search(r"\b(?:or|maybe|possibly|perhaps)\b", joined, re.I):
        return False  # (a) \boxed{7} or \boxed{6}: the first part is a hedge
    return equivalent(", ".join(c for _, _, c in last), golds, deadline)


def _bare(line):
    """`line` as an answer when it is only a value: "42", "x = 3", "1,234", "33.5%", "3+2",
    "$\\frac13 $", "\\[ 9 \\]", "$28$ %", "$1,000.99" (money), "[45 degrees]" (Geometry3K's
    brackets), "C"; else None. Words other than function names and one unit after a number
    ("45 degrees") make it prose, and so do letters of other scripts."""
    s = line.strip()
    s = s[:-1].rstrip() if s.endswith(".") and not s.endswith("..") else s
    if re.fullmatch(r"\[[^\[\],;]*\]", s):
        s = s[1:-1].strip()  # [45], [$\sqrt{4}$]
    span = SPAN.fullmatch(s)
    if span:  # any one math span ($odd$); an inline one on one line only ($ \n 9 \n $ is not math)
        inner = next(g for g in span.groups() if g is not None).strip()
        return inner or None if not ((span.group(2) or span.group(3)) and "\n" in inner) else None
    if "\n" in s:
        return None
    # $28$ %
    s = SPAN.sub(lambda m: " %s " % next(g for g in m.groups() if g is not None), s).strip()
    s = re.sub(r"^\\?\$(?=\d)|(?<=\d)\\?\$$", "", s)  # $1,000.99, 1,000.99$, \$10: money
    if not re.search(r"[0-9A-Za-z]", s) or len(s) > 300 or re.search(r"\$|\\[(\[]|" + _FOREIGN, s):
        return None
    words = re.sub(r"\\(?:text|mbox|mathrm|begin|end)\s*\{[^{}]*\}", " ", s)  # \text{ cm}: a unit
    unit = re.search(r"(?<=\d)\s*([a-zA-Z]{2,})$", words)  # 45 degrees; not "5 is wrong", "5 or"
    words = words[: unit.start()] if unit and unit.group(1).lower() not in _NOT_UNIT else words
    return None if any(w.lower() not in WORDS
                       for w in re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}", words)) else s


def _from_bare(text):
    """A response that is only a value (_bare), or whose last line (or display block) is one after a
    finished sentence or a colon ("First compute 6*7.\\n42"); not a line of a list of values
    ("1\\n2\\n3")."""
    text = text.strip()
    whole = _bare(text)
    if whole is not None or "\n" not in text:
        return whole
    opener = {"$$": "$$", "\\]": "\\["}.get(text[-2:])  # last block: a display, else the last line
    at = text.rfind(opener, 0, len(text) - 2) if opener else -1
    before, block = (text[:at], text[at:]) if at >= 0 else text.rsplit("\n", 1)
    before = before.rstrip()
    if not before.endswith((".", "!", "?", ":", "。", "：")) or \
            _bare(before.rsplit("\n", 1)[-1]) is not None:
        return None
    return _bare(block)


def extract_final(response, deadline):
    """-> (answer or None, the text it was found in, the boxes of that text as find_boxes gives
    them). With </think>, only the text after it is searched (nothing there: no answer); an
    unfinished <think> has no answer."""
    text = next((t for t in _TURN_END.split(response[-TAIL_CHARS:]) if t.strip()), "")
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None, "", []  # the reasoning never ended
    boxes = find_boxes(text, deadline)
    if boxes:
        return from_boxes(text, boxes, deadline), text, boxes
    tags = re.findall(r"<answer>(.*?)</answer>", text[-5000:], re.DOTALL)
    answer = tags[-1].strip() if tags else from_phrase(text[-5000:])
    for read in (_from_bare, from_conclusion):
        answer = read(text[-2000:]) if answer is None else answer
    return answer or None, text, []


