"""Final-answer extraction, answer equivalence and the +-1 reward (docs/paper.md §1 and §6: the DAPO reward on the last
\\boxed{}; §7: rule-based grading of the benchmarks).

`grade(response, gold)` takes the final answer of a response (after </think> only; the last \\boxed{...}, else "the
answer is ..." phrases, a response or last line that is only a value, or a final sentence stating one value, a relation
read whole; never "the last number in the text"; nothing after a chat-template token) and decides whether it equals
the gold. Answers are read by a small hand-written tokenizer + recursive-descent parser for math answers that builds
sympy objects directly: model output never reaches eval, exec, sympify or parse_expr. `graded_chars` (and, for token
ids, `graded_count`) says how much of a response the reward reads: up to and including its answer.

Deliberate differences from the paper and from common graders (verl, Math-Verify, Qwen2.5-Math):
1. The paper compares normalized strings (`mode="strict"` keeps that); the default compares values, because a string
   match rejects right answers in another form (1/2 = 0.5 = \\frac{2}{4}, x=5 vs 5, 1,000 vs 1000).
2. Numbers compare exactly (sympy Rationals): 0.33 is not 1/3 and 0.0011 is not 0.001. The one tolerance: a gold
   that is itself a rounded decimal (a decimal literal with a nonzero fraction, or scientific notation, with >= 2
   significant digits) accepts a prediction in exact, non-decimal form (a fraction, radical, pi, ...) whose value
   lies strictly within half a unit of the gold's last digit. A decimal prediction must equal a decimal gold exactly.
3. Hedged answers ("3 or 4", "3 and 4", "\\boxed{3} or \\boxed{4}") are lists of two answers and are wrong for a
   one-answer gold; an empty or unterminated last box is wrong; a retracted answer is its last box. Several boxes are
   one answer per part only for a gold of as many answers, with no hedge or retraction among them. A multiple-choice
   gold accepts only its own letter, alone or with its own label text: an answer that only starts with the letter
   ("E+1", "B = 7") or lists other choices ("B, C", "A B C D E") is wrong, or listing every choice would always pay.
4. Every grade is bounded without signals (so it works in threads and worker processes): the response tail, the
   answer length, token count, nesting depth, digits, exponents, factorials and trig arguments are capped and one
   deadline, started when grade() is called, is checked while extracting boxes, in the parser and between
   comparisons; nested boxes are never joined (a box inside a box is its content). Anything refused or late grades
   as not equivalent.
5. Any Python function can be the reward instead (`reward(response, gold, "FILE.py:FUNCTION")`, `load_reward`), as
   TRL takes reward functions: it may read the prompt and the data row's other fields by keyword, and be batched;
   whatever the reward, a response is correct when its reward is positive (`correct`).
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
from collections import namedtuple

import sympy as sp

from command_line.errors import InputError

# ------------------------------------------------------------------------------------------------ limits
TIMEOUT_S = 1.0  # wall-clock budget of one grade() call
TAIL_CHARS = 100_000  # only the end of a response is searched for its final answer
MAX_ANSWER_CHARS = 2_000  # longer answers are compared as strings only (and over 10x this, not at all)
MAX_TOKENS = 1_000
MAX_DEPTH = 60  # parser recursion (nested braces, parentheses, powers)
MAX_DIGITS = 2_000  # digits of one number literal
MAX_BITS = 1 << 16  # size of an exact number built by ^, *, ! (about 20,000 digits)
MAX_LOG_MAGNITUDE = 2e4  # |ln|value|| of a power with a non-integer exponent
MAX_TRIG_ARGUMENT = 1e6  # |x| of sin x, cos x, ... (symbols set to 1): larger ones take seconds to evaluate
MAX_FACTORIAL = 5_000
MAX_SYMBOLIC_EXPONENT = 10_000  # n in x^n when x has a symbol


class Refused(Exception):
    """The answer cannot be read, or is too large, too deep or too slow to grade."""


def _tick(deadline):
    if time.monotonic() > deadline:
        raise Refused("time limit")


# ------------------------------------------------------------------------------------------------ public API
def _golds(gold):
    """A gold answer as a list of strings: a list means several answers (OlympiadBench); 27.0 -> "27.0"; None: none."""
    return [str(g) for g in ([gold] if isinstance(gold, (str, int, float)) else gold or [])]


def extract_answer(response, timeout=TIMEOUT_S):
    """The final answer of a response as a string ('' for an empty box), or None when there is none (or no answer
    could be found within `timeout` seconds)."""
    try:
        return _extract(response, time.monotonic() + timeout)[0] if isinstance(response, str) else None
    except Refused:
        return None


def grade(response, gold, timeout=TIMEOUT_S):
    """Whether the final answer of `response` equals `gold` (a string, or a list of strings for several answers);
    extraction and comparison together stop within about
    `timeout` seconds (the deadline starts here; measured: at most ~0.15 s later on hostile inputs, docs/grader.md)."""
    deadline = time.monotonic() + timeout
    try:
        answer, text, boxes = _extract(response, deadline) if isinstance(response, str) else (None, "", [])
    except Refused:
        return False
    golds = _golds(gold)
    if not (answer and answer.strip() and golds):
        return False
    return _equivalent(answer, golds, deadline) or _parts(text, boxes, golds, deadline)


def reward(response, gold, mode="dapo", row=None):
    """The RL reward. "dapo": +1 / -1 by `grade`; "binary": 1 / 0; "strict": +1 / -1 by the paper's rule, a
    normalized string match of the last \\boxed{} only; "FILE.py:FUNCTION" or "MODULE:FUNCTION": your function
    (`load_reward`), called as FUNCTION(response, gold, **the fields of `row` it takes), row = the data row the
    response answers ({"problem", "fields"}, data.read_rows). A response is correct when its reward is positive."""
    if ":" in mode:
        return _call(load_reward(mode), mode, [response], [gold], [row])[0]
    if mode == "strict":
        deadline = time.monotonic() + TIMEOUT_S
        try:
            boxes = _extract(response, deadline)[2] if isinstance(response, str) else []
            box = boxes[-1][2] if boxes else None
            pred = _clean(box, deadline)[0] if box else ""
            golds = ", ".join(_clean(g, deadline)[0] for g in _golds(gold))
        except Refused:
            return -1.0
        return 1.0 if pred and _squash(pred) == _squash(golds) else -1.0
    if mode not in BUILTIN:
        raise ValueError(f"unknown reward {mode!r}; valid: {', '.join(BUILTIN)}, or your own as FILE.py:FUNCTION or "
                         f"MODULE:FUNCTION")
    return 1.0 if grade(response, gold) else (0.0 if mode == "binary" else -1.0)


def rewards(responses, golds, mode="dapo", rows=None):
    """`reward` of each response (golds[i], rows[i]: its gold and data row; rows None: none); your own function
    declared batched is called once, with lists (`_call`). train.py's and eval.py's call."""
    if ":" not in mode:  # the built-in modes read no row
        return [reward(response, gold, mode) for response, gold in zip(responses, golds)]
    fn, rows = load_reward(mode), [None] * len(responses) if rows is None else list(rows)
    if getattr(fn, "batched", False):
        return _call(fn, mode, list(responses), list(golds), rows)
    return [_call(fn, mode, [response], [gold], [row])[0] for response, gold, row in zip(responses, golds, rows)]


def correct(response, gold, mode="dapo", row=None):
    """Whether `response` is correct under the reward `mode`: its reward is positive. train.py's reward/acc and
    held-out accuracy and eval.py's avg@k count this (for dapo and binary it is `grade`)."""
    return rewards([response], [gold], mode, [row])[0] > 0


def graded_chars(response, mode="dapo"):
    """How many leading characters of `response` the reward reads, up to and including the answer (the rest is
    text after the graded answer, which the reward cannot see): for the built-in modes, the end of the last
    occurrence of the extracted answer (the whole response when there is none); for your own reward function, the
    `graded_chars(response)` its module defines (tasks/chain_sums.py), else the whole response."""
    if ":" in mode:
        own = getattr(load_reward(mode), "__globals__", {}).get("graded_chars")
        return int(own(response)) if callable(own) else len(response)
    answer = extract_answer(response)
    at = response.rfind(answer) if answer else -1
    return len(response) if at < 0 else at + len(answer)


def graded_count(tokenizer, ids: list[int], mode: str) -> int:
    """How many leading tokens of a response (ids; `tokenizer` decodes them) hold the characters the reward reads
    (`graded_chars`): the fewest whose decoded text has them, by bisection on the decoded length of the response's
    prefixes."""
    chars = graded_chars(tokenizer.decode(ids, skip_special_tokens=True), mode)
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars else (mid + 1, hi)
    return lo


# ------------------------------------------------------------------------------------------------ your own reward
# Any verifier can be the reward (code that runs tests, a format check, another grader), as TRL's reward functions
# are: --reward FILE.py:FUNCTION or MODULE:FUNCTION names a Python function
#
#     def FUNCTION(response: str, answer: str | list[str], prompt=None, **row) -> float
#
# called once per sampled response with the row's gold answer (--answer-key: a string, or a list of strings), in the
# training and held-out evaluation of train.py and in eval.py. After (response, answer) it may take, by keyword, any
# of the data row's fields (`units=None`, or all of them as **row) and `prompt`, the problem text as --prompt-key
# gave it (without the instruction); a parameter without a default is a field every row must have. Declared batched
# (`FUNCTION.batched = True`), it is called once per step (eval.py: per generate call) with lists: responses,
# answers and each keyword (a row without the field gives None there), and returns a list of as many numbers. It
# returns a finite number (a bool counts as 1 / 0): any scale works, since the advantages are group-normalized, but
# the reward must be positive exactly when the response is correct (reward/acc, held-out accuracy and avg@k count
# positive rewards). examples/: reward_last_line.py (two arguments), reward_with_row.py (fields, and batched).
BUILTIN = ("dapo", "binary", "strict")
OWN = ("response", "answer")  # what your function gets first: row fields of these names are not passed again


class RewardError(InputError):
    """Your reward function raised, or returned something other than a finite number."""


@functools.lru_cache(maxsize=None)
def load_reward(spec):
    """The function `spec` names, checked: a built-in mode ("dapo", "binary", "strict": reward itself), or
    "FILE.py:FUNCTION" (a Python file, path relative to the working directory) or "MODULE:FUNCTION" (an importable
    module). A missing file or module, an error while importing it, a missing or non-callable FUNCTION, or one that
    cannot be called with (response, answer) and its keywords raises ValueError in one line. Loaded once per
    process."""
    if spec in BUILTIN:
        return functools.partial(reward, mode=spec)
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"unknown reward {spec!r}; valid: {', '.join(BUILTIN)}, or your own as FILE.py:FUNCTION or "
                         f"MODULE:FUNCTION")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ValueError(f"reward {spec}: no such file {where}")
            module_spec = importlib.util.spec_from_file_location(f"_reward_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises while it is imported
        raise ValueError(f"reward {spec}: importing {where} raised {type(e).__name__}: {_first_line(e)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec}: {where} has no function {name}")
    try:
        inspect.signature(fn).bind("response", "answer", **dict.fromkeys(_takes(fn)[1]))
    except TypeError:
        raise ValueError(f"reward {spec}: {name} must take two arguments, (response, answer), and then the row's "
                         f"fields by keyword") from None
    except ValueError:  # no signature to inspect (some builtins): the first call will tell
        pass
    return fn


@functools.lru_cache(maxsize=None)
def _takes(fn):
    """(the row fields fn takes by keyword after (response, answer): their names, or None for all of them (**row);
    those without a default, which every row must have)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return (), ()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    every = any(p.kind is p.VAR_KEYWORD for p in params)
    return (None if every else tuple(p.name for p in named)), tuple(p.name for p in named if p.default is p.empty)


def _keywords(fn, spec, rows, batched):
    """The keywords of fn's call for these rows (one, or a batch's lists): `prompt` (the problem) and the row's fields
    that fn takes (`_takes`); a field it needs that a row lacks is a RewardError naming it."""
    names, needed = _takes(fn)
    if names == ():
        return {}
    fields = [{} if row is None else {**{k: v for k, v in row.get("fields", {}).items() if k not in OWN},
                                      "prompt": row["problem"]} for row in rows]
    for f in fields:
        missing = [n for n in needed if n not in f]
        if missing:
            raise RewardError(f"reward function {spec} takes {missing[0]!r}, a field this row lacks (its fields: "
                              f"{', '.join(f) or 'none'}); give it a default")
    keys = [k for k in dict.fromkeys(k for f in fields for k in f) if names is None or k in names]
    return {k: [f.get(k) for f in fields] for k in keys} if batched else {k: fields[0][k] for k in keys}


def _call(fn, spec, responses, golds, rows):
    """fn's rewards of the responses (lists; one call with lists if fn is batched, else fn(response, gold, **fields)
    for the one response) as floats; anything it raises, or a value that is not a finite number, is a RewardError
    naming the function (and, for an exception, the file:line that raised it)."""
    batched = getattr(fn, "batched", False)
    keywords = _keywords(fn, spec, rows, batched)
    try:
        values = fn(responses, golds, **keywords) if batched else [fn(responses[0], golds[0], **keywords)]
    except Exception as e:  # noqa: BLE001 - the user's code: any exception becomes one line naming it and where
        at = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where it was raised
        raise RewardError(f"reward function {spec} raised {type(e).__name__} at {at.filename}:{at.lineno}: "
                          f"{_first_line(e)}") from e
    if batched and (isinstance(values, (str, bytes)) or not hasattr(values, "__len__")
                    or len(values) != len(responses)):
        raise RewardError(f"reward function {spec} returned {values!r:.60}, not a list of {len(responses)} numbers "
                          f"(it is batched: one per response)")
    for value in values:
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward function {spec} returned {value!r:.60}, not a finite number")
    return [float(v) for v in values]


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


# ------------------------------------------------------------------------------------------------ extraction
_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])\s*(\{)?|(?<![a-zA-Z\\])boxed(\{)")  # also a bare boxed{5}
_LAYOUT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}|\\[,;:! ()\[\]]|\\q?quad|[\s$*().]")
# what may stand between two boxes of one answer, once _LAYOUT is removed: "3, 5", "3 or 4", "x = 3 or x = 4"
_JOINED = re.compile(r"(?:,|;|&|/|and|or)?(?:maybe|possibly|perhaps)?(?:[a-zA-Z](?:_\w)?=)?")
# right after an answer, a second value: "\boxed{3} (or maybe 4)", "The answer is 3. Or it could be 4." (a hedge); not
# "Alternatively, we could solve ..." (another method)
_HEDGE = re.compile(r"[\s$.,;:)\]}*]*\(?\s*(?:or|maybe|possibly|perhaps|alternatively),?\s+(?:maybe\s+|possibly\s+|"
                    r"perhaps\s+|it (?:could|might) be\s+)?[$\\(]*\s*-?\.?\d", re.I)
_PHRASE = re.compile(r"(?:(?:final\s+)?answer(?:\s*\*\*)?\s*(?:is\b|:|=|(?:should|would|must|will) be\b)|"
                     r"final\s+answer\b|(?P<bare>(?:^|(?<=\n))[ \t*#]*answer\**[ \t]+(?=[-$\\(\d]))|"  # "Answer 5"
                     r"####|答案\s*(?:是|为|:|：)|r[ée]ponse\s*(?:est\b|:))[\s*:]*", re.I)
_SENTENCE = re.compile(r"the\s.{0,80}?\s(?:is|are)\s+(.+)", re.I | re.DOTALL)  # Minerva's "The largest $n$ is 34."
# the end of the model's turn: what follows a chat-template token (an invented next turn) is not its answer
_RETRACT = re.compile(r"\b(?:wait|actually|instead|mistake|wrong|incorrect|error|re-?check|correction|oops)\b", re.I)
_TURN_END = re.compile(r"<\|[a-z_]{2,30}\|>|<(?:start|end)_of_turn>|</s>")
_CUT = re.compile(r"\.(?=\s|$)|。|\n|,?\s+(?:since|because|as|which|where|so)\b|,\s*(?:since|because|which|so)\b|"
                  r"\s\((?:i\.e\.|e\.g\.|that is|approx|about|rounded)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s?\\?%)?")  # 35, 1,234, 2.5, 100%
_HOPE = re.compile(r"\s*I hope it is correct\.?$", re.I)  # Minerva's closing sentence
# "... is 2/3.", "... is $(7, 6)$" (a closed $...$ needs no period), Geometry3K's "The angle is [90]."
_STATED = re.compile(r"\s(?:is|are|equals|=)\s+(?:\$([^$]{1,200})\$[.!]?|(-?\d+(?:\.\d+)?/\d+)[.!]|"
                     r"\[\s*([^\[\]a-zA-Z]{1,50}?)\s*\][.!])$")
# a value in math delimiters: $...$, \(...\), \[...\] (a sentence's one span is its answer: "We find that $x < 3$.")
_SPAN = re.compile(r"\$\$([^$]{1,300})\$\$|\$([^$]{1,300})\$|\\\((.{1,300}?)\\\)|\\\[(.{1,300}?)\\\]", re.DOTALL)
_BOLD = re.compile(r"\*\*([^*]{1,60})\*\*")  # a value in bold: "... هو **92**.", "一共有**858颗**糖果。"
_RELATION = re.compile(r"[<>≤≥≠]|!=|\\(?:le|ge|ne|lt|gt|leq|geq|neq)(?![a-zA-Z])")  # x >= 5 is no number's answer
# English, Chinese and Hindi sentence ends; a capital word after a math span ("... = 6$ So, the pair is ...")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？।])|(?<=\$)\s+(?=[A-Z][a-z])")
_FOREIGN = r"[^\x00-\x7f°²³¹⁰⁴-⁹⁻π√≤≥≠±−×÷∞€£¥]"  # letters of other scripts: prose, not a value
_NOT_UNIT = {"or", "and", "not", "no", "is", "wrong", "maybe", "perhaps", "possibly", "approximately", "about"}
_PLAN = re.compile(r"(?:let|first|next|then|to|we (?:need|want|must)|find|compute|calculate|determine|suppose|given|"
                   r"if|consider|or|maybe|perhaps|possibly|alternatively)\b", re.I)


def _brace(m):
    """Index of the opening brace of a _BOX match, or None (\\boxed 5)."""
    return m.start(1) if m.group(1) else m.start(2) if m.group(2) else None


def _boxes(text, deadline):
    """(start, end, content) of every top-level \\boxed{...} / \\fbox{...} / \\boxed x in order; content None: never
    closed. A box inside another box is part of its content, so contents never overlap and slicing them is linear;
    a box that holds only a box (\\boxed{\\boxed{5}}) is its inner box."""
    closer, stack = {}, []
    for m in re.finditer(r"[{}]", text):  # one linear pass of brace matching
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closer[stack.pop()] = m.start()
    out, inside = [], -1  # inside: the end of the last closed box
    for m in _BOX.finditer(text):
        _tick(deadline)
        if m.start() < inside:
            continue
        brace = _brace(m)
        if brace is None:
            word = re.match(r"[^\s$\\,]+", text[m.end() : m.end() + 100])
            out.append((m.start(), m.end() + len(word.group()), word.group().rstrip(".")) if word else (0, 0, None))
        elif closer.get(brace) is None:
            out.append((m.start(), None, None))
        else:
            lo, inside = brace + 1, closer[brace]
            hi = inside
            while (inner := _BOX.match(text, lo)) and _brace(inner) is not None and closer.get(_brace(inner)) == hi - 1:
                lo, hi = _brace(inner) + 1, hi - 1
            out.append((m.start(), inside + 1, text[lo:hi]))
    return out


def _from_boxes(text, boxes, deadline):
    """The last box, joined with the boxes just before it that only a comma, "and" or "or" separates from it
    ("\\boxed{3} and \\boxed{5}" -> "3, 5"; "\\boxed{3} or \\boxed{4}" -> "3 or 4", a hedge)."""
    start, end, answer = boxes[-1]
    if answer is None:
        return None  # the response was cut inside its last box
    if _HEDGE.match(text[end : end + 100]):
        return ""  # \boxed{3} (or maybe 4): a hedge, no answer
    run, seen, size, sep = [answer], {answer}, len(answer), ", "
    for begin, end, content in reversed(boxes[:-1]):
        _tick(deadline)
        between = text[end:start]
        if content is None or len(between) > 40 or not _JOINED.fullmatch(_LAYOUT.sub(r"\1", between).lower()):
            break
        sep = " or " if "or" in between else sep
        if content not in seen:
            run, size = [content] + run, size + len(content)
            seen.add(content)
        start = begin
        if size > 10 * MAX_ANSWER_CHARS:
            break  # already too long to be a final answer (see _equivalent)
    return sep.join(run)


def _parts(text, boxes, golds, deadline):
    """A gold of k > 1 answers against the last k boxes, one per part ("(a) \\boxed{6} ... (b) \\boxed{15}"), when
    none of them is unterminated, empty or hedged and no retraction stands between them."""
    try:
        k = len(golds) if len(golds) > 1 else len(_parse(_clean(golds[0], deadline)[0], deadline))
    except Exception:  # Refused, or anything sympy raises: a gold that cannot be counted has no parts
        return False
    last = boxes[-k:]
    if not 1 < k <= len(boxes) or any(not (c and c.strip()) or _HEDGE.match(text[e : e + 100]) for _, e, c in last):
        return False
    if _RETRACT.search(text[last[0][1] : last[-1][0]]):
        return False  # \boxed{3} ... wait, actually \boxed{5}: the second replaces the first
    joined = text[boxes[-k - 1][1] : last[0][0]] if len(boxes) > k and boxes[-k - 1][1] else ""
    if len(joined) <= 40 and re.search(r"\b(?:or|maybe|possibly|perhaps)\b", joined, re.I):
        return False  # (a) \boxed{7} or \boxed{6}: the first part is a hedge
    return _equivalent(", ".join(c for _, _, c in last), golds, deadline)


def _from_phrase(text):
    """Without a box: the text after the last "the answer is" / "Answer:" / "####", to the end of its sentence; a bare
    "Answer 5" (no colon) only on the last line, not as a heading ("Answer 2. The value is 7.\n...")."""
    phrases = list(_PHRASE.finditer(text))
    rest = text[phrases[-1].end() :].strip() if phrases else ""
    display = re.fullmatch(r"\\\[.*\\\]|\$\$.*\$\$", rest, re.DOTALL)
    if not phrases or phrases[-1].group("bare") and "\n" in rest and not display:
        return None  # "Answer 2. ...\n..." is a heading; "Answer \[ \n 9 \n \]" a display
    rest = text[phrases[-1].end() :].lstrip(" *")
    rest = rest.lstrip("\n") if rest.startswith(("\n\\[", "\n$$")) else rest
    for a in ("\\[", "\\]", "\\(", "\\)", "$"):
        rest = rest.replace(a, "")
    answer, *after = _CUT.split(rest.strip(), 1)
    if after and _HEDGE.match(after[0]):
        return ""  # "3. Or maybe 4." is a hedge: no answer
    sentence = _SENTENCE.fullmatch(answer)
    answer = (sentence.group(1) if sentence else answer).strip(" *")
    if len(re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}", answer)) >= 3:  # "Jane started growing Sphere 3 hours ago"
        return _from_conclusion(answer + ".") or answer  # a sentence: the one value it states
    return answer


def _from_conclusion(text):
    """Without a box or phrase: a complete final sentence that states one value: its one math span ("We find that $x <
    3$."), one bold value ("... هو **92**."), a value after "is" ("... the probability that Alice wins is 2/3.", "The
    result is $3$", "The angle is [90]."), or its one number ("So Tom has 35 apples left."; not one in a relation: "x
    >= 5"). Minerva's closing "I hope it is correct." is skipped. Not "the last number in the text": truncated,
    hedged, multi-value or planning ("Let ...") endings give None."""
    last = _HOPE.sub("", text.strip()).rsplit("\n", 1)[-1].strip()
    sentence = [s for s in _SENTENCE_END.split(last) if s.strip()][-1:] or [""]
    sentence = sentence[0].strip()
    if _PLAN.match(sentence) or re.search(r"\b(?:or|maybe|possibly|perhaps|not|never|cannot)\b|n't\b", sentence, re.I):
        return None  # a plan, a hedge or a negation ("It is not 5.")
    stated = _STATED.search(sentence[-300:])
    if stated:
        return next(g for g in stated.groups() if g is not None).strip()
    complete = sentence.endswith((".", "!", "。", "！", "।")) and len(sentence) <= 300
    spans = [next(g for g in m.groups() if g is not None) for m in _SPAN.finditer(sentence)]
    bold = [m.group(1) for m in _BOLD.finditer(sentence) if _NUMBER.search(m.group(1))]
    if len(spans) + len(bold) > 1 or not (complete or spans and sentence.endswith(("$", "\\)", "\\]"))):
        return None
    if spans or bold:
        return (spans or bold)[0].strip()
    numbers = _NUMBER.findall(sentence)
    if len(sentence.split()) > 20 or _RELATION.search(sentence) or len(numbers) != 1:
        return None
    return numbers[0].rstrip(",")


def _bare(line):
    """`line` as an answer when it is only a value: "42", "x = 3", "1,234", "33.5%", "3+2", "$\\frac13 $",
    "\\[ 9 \\]", "$28$ %", "$1,000.99" (money), "[45 degrees]" (Geometry3K's brackets), "C"; else None. Words other
    than function names and one unit after a number ("45 degrees") make it prose, and so do letters of other scripts."""
    s = line.strip()
    s = s[:-1].rstrip() if s.endswith(".") and not s.endswith("..") else s
    if re.fullmatch(r"\[[^\[\],;]*\]", s):
        s = s[1:-1].strip()  # [45], [$\sqrt{4}$]
    span = _SPAN.fullmatch(s)
    if span:  # one math span, whatever it holds ($odd$); an inline one on one line ($ \n 9 \n $ is not math)
        inner = next(g for g in span.groups() if g is not None).strip()
        return inner or None if not ((span.group(2) or span.group(3)) and "\n" in inner) else None
    if "\n" in s:
        return None
    s = _SPAN.sub(lambda m: " %s " % next(g for g in m.groups() if g is not None), s).strip()  # $28$ %
    s = re.sub(r"^\\?\$(?=\d)|(?<=\d)\\?\$$", "", s)  # $1,000.99, 1,000.99$, \$10: money
    if not re.search(r"[0-9A-Za-z]", s) or len(s) > 300 or re.search(r"\$|\\[(\[]|" + _FOREIGN, s):
        return None
    words = re.sub(r"\\(?:text|mbox|mathrm|begin|end)\s*\{[^{}]*\}", " ", s)  # \text{ cm}: a unit
    unit = re.search(r"(?<=\d)\s*([a-zA-Z]{2,})$", words)  # 45 degrees; not "5 is wrong", "5 or"
    words = words[: unit.start()] if unit and unit.group(1).lower() not in _NOT_UNIT else words
    return None if any(w.lower() not in _WORDS for w in re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}", words)) else s


def _from_bare(text):
    """A response that is only a value (_bare), or whose last line (or display block) is one after a finished
    sentence or a colon ("First compute 6*7.\\n42"); not a line of a list of values ("1\\n2\\n3")."""
    text = text.strip()
    whole = _bare(text)
    if whole is not None or "\n" not in text:
        return whole
    opener = {"$$": "$$", "\\]": "\\["}.get(text[-2:])  # the last block: a display, else the last line
    at = text.rfind(opener, 0, len(text) - 2) if opener else -1
    before, block = (text[:at], text[at:]) if at >= 0 else text.rsplit("\n", 1)
    before = before.rstrip()
    if not before.endswith((".", "!", "?", ":", "。", "：")) or _bare(before.rsplit("\n", 1)[-1]) is not None:
        return None
    return _bare(block)


def _extract(response, deadline):
    """-> (answer or None, the text it was found in, the boxes of that text as _boxes gives them). With </think>, only
    the text after it is searched (nothing there: no answer); an unfinished <think> has no answer."""
    text = next((t for t in _TURN_END.split(response[-TAIL_CHARS:]) if t.strip()), "")
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None, "", []  # the reasoning never ended
    boxes = _boxes(text, deadline)
    if boxes:
        return _from_boxes(text, boxes, deadline), text, boxes
    tags = re.findall(r"<answer>(.*?)</answer>", text[-5000:], re.DOTALL)
    answer = tags[-1].strip() if tags else _from_phrase(text[-5000:])
    for read in (_from_bare, _from_conclusion):
        answer = read(text[-2000:]) if answer is None else answer
    return answer or None, text, []


# ------------------------------------------------------------------------------------------------ normalization
_REPLACE = [("\\\\", " \\rowsep "), ("**", "^"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"),
            ("\\displaystyle", ""), ("\\textstyle", ""), ("\\!", ""), ("\\,", " "), ("\\;", " "), ("\\:", " "),
            ("~", " "), ("\\qquad", " "), ("\\quad", " "), ("\\$", ""), ("$", " "),
            ("\\(", ""), ("\\)", ""), ("€", ""), ("£", ""), ("¥", ""), ("\\varnothing", "\\emptyset"), ("−", "-"),
            ("×", "\\times "), ("÷", "\\div "), ("≤", "\\le "), ("≥", "\\ge "), ("≠", "\\ne "), ("≈", "\\approx "),
            ("∞", "\\infty "), ("π", "\\pi "), ("√", "\\sqrt "), ("°", ""), ("\\degree", ""), ("\\mbox", "\\text"),
            ("\\dbinom", "\\binom"), ("\\tbinom", "\\binom"), ("\\langle", "("), ("\\rangle", ")"),
            ("\\mathbb{R}", "\\reals"), ("\\lvert", "|"), ("\\rvert", "|"), ("\\vert", "|"), ("\\mid", "|")]
_WRAPPERS = (r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|mathrm|mathbf|mathit|mathsf|mathtt|boldsymbol|"
             r"operatorname|underline|emph|bf|rm)")
_UNWRAP = re.compile(_WRAPPERS + r"\s*\{")
_UNIT = re.compile(r"(?<=[\d}).!])\s*" + _WRAPPERS + r"\s*\{\s*(?!and\b|or\b)[a-zA-Z][a-zA-Z ./]*\}(\s*\^\s*\{?\d\}?)?")
_UNIT_WORDS = re.compile(r"(?:(?<=[\d}])|(?<=\\pi))\s+(?!and\b|or\b)[a-zA-Z]{2,}\.?(?:\s+[a-zA-Z]{2,}\.?)*"
                         r"(\s*\^\s*\{?\d\}?)?$")
_DROP = re.compile(r"\\(?:left|right|[bB]igg?[lr]?|tiny|small|normalsize|large|Large|LARGE|huge|Huge)(?![a-zA-Z])|"
                   r"\\(?:text)?color\s*\{[^{}]*\}|\\hspace\*?\{[^{}]*\}")  # sizes, colors, spaces
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
_PERCENT = re.compile(r"\\?%|\bpercent\b")
_MATRIX = [(re.compile(r"\\begin\{array\}\{[^{}]*\}|\\begin\{[pbvBV]?matrix\}"), " \\matbegin "),
           (re.compile(r"\\end\{array\}|\\end\{[pbvBV]?matrix\}"), " \\matend ")]


def _repeating(m):  # 0.1\overline{6} -> (15/90)
    whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3)
    return f"({int(whole + fixed + period) - int(whole + fixed)}/{10 ** len(fixed) * (10 ** len(period) - 1)})"


def _closing(s, start):
    """Index of the brace that closes the one at s[start], or None."""
    depth = 0
    for k in range(start, len(s)):
        depth += {"{": 1, "}": -1}.get(s[k], 0)
        if depth == 0:
            return k
    return None


def _unwrap(s, deadline, limit=20):
    """\\text{...}, \\mathbf{\\frac{1}{2}}, ...: keep the content; also drop redundant outer braces ({5}, {{5}})."""
    for _ in range(limit):
        _tick(deadline)
        m = _UNWRAP.search(s)
        end = _closing(s, m.end() - 1) if m else None
        if end is None:
            break
        s = s[: m.start()] + s[m.end() : end] + s[end + 1 :]
    for _ in range(3):
        if not s.startswith("{") or _closing(s, 0) != len(s) - 1 or "\\over" in s:  # {3 \over 4} is a fraction
            break
        s = s[1:-1].strip()
    return s


def _clean(s, deadline):
    """String-level normalization of one answer -> (text, had a percent sign)."""
    s = re.sub(r"(?<!\\)\\(?=\s|$)", " ", s).strip()  # "\ " (a space), also at the end: 185\
    if "####" in s:  # a GSM8K solution as gold
        s = s.rsplit("####", 1)[1]
    if "\\boxed" in s or "\\fbox" in s:  # a full solution as gold: its last box, or the boxes joined to it
        boxes = _boxes(s, deadline)
        s = (boxes[-1][2] and _from_boxes(s, boxes, deadline)) or next((c for _, _, c in reversed(boxes) if c), s)
    elif ("\n" in s.strip() or len(s) > 200) and _PHRASE.search(s):  # "Alina and the answer is\n(C) Cecile"
        s = _from_phrase(s) or s
    if "\\begin" not in s:
        s = re.sub(r"\\\\(?=[a-zA-Z])", r"\\", s)  # \\dfrac (escaped twice) is \dfrac, outside a matrix
    if len(s) > 10 * MAX_ANSWER_CHARS:
        return s, False  # not a final answer: left as it is
    s = re.sub(r",\s*\\!\s*|\s*\{\s*,\s*\}\s*", ",", s)  # 111,\!111 and 14 {, }916: a thousands separator
    for a, b in _REPLACE:
        s = s.replace(a, b)
    s = _DROP.sub("", s)
    s = re.sub(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+", lambda m: "^{%s}" % m.group().translate(_SUPERSCRIPTS), s)  # 10⁻⁵
    s = re.sub(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ\b", " ", s)  # degrees (a space: 45^\circ,135^\circ is a list)
    percent = bool(_PERCENT.search(s))
    s = _UNIT.sub("", _PERCENT.sub("", s))
    s = _unwrap(s, deadline)
    for pattern, repl in _MATRIX:
        s = pattern.sub(lambda m, r=repl: r, s)
    s = re.sub(r"\s+", " ", s).rstrip(" .,;:。，").lstrip(" ,;:")
    s = re.sub(r"^(?:the )?(?:final )?answer(?: is\b|:)\s*", "", s, flags=re.I)
    s = _UNIT_WORDS.sub("", s).strip()
    s = re.sub(r"(?<=\d)\s*[\u3040-\u9fff\uac00-\ud7af]{1,4}$", "", s)  # 858颗, 3页: a unit
    s = re.sub(r"\b(?:degrees?|dollars?|cents?|units?)$", "", s).strip()
    s = re.sub(r"(?<![A-Za-z\d_])\(?(\d+)\)?_\{?\(?\d+\)?\}?", r"\1", s)  # base subscript: (1011)_2 -> 1011
    s = re.sub(r"(\d{0,50})\.(\d{0,50})\\overline\s*\{(\d{1,50})\}", _repeating, s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)|\\frac\s*(\{[^{}]*\})\s*(\d)", lambda m: "\\frac{%s}{%s}" % (
        m.group(1) or m.group(3).strip("{}"), m.group(2) or m.group(4)), s)  # \frac12, \frac{x}2
    s = re.sub(r"(?<![\d.}^_a-zA-Z\\])(\d+)\s*\\frac\s*\{(\d+)\}\s*\{(\d+)\}", r"(\1+\2/\3)", s)  # 2\frac13
    s = re.sub(r"^(\d+) (\d+)/(\d+)$", r"(\1+\2/\3)", s)  # 2 1/3
    s = re.sub(r"(\d)\s*[x*]\s*10\^", r"\1\\times 10^", s)  # 3.2 x 10^5
    if re.fullmatch(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?|[+-]?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?", s):  # 1,234
        s = s.replace(",", "").replace(" ", "")
    return s, percent


def _squash(s):
    s = re.sub(r"\s+", "", s)
    return s.lower() if re.fullmatch(r"[A-Za-z]{2,}", s) else s


_DECIMAL = re.compile(r"[+-]?(\d*)(?:\.(\d*))?(?:e([+-]?\d+)|\\(?:times|cdot)10\^\{?([+-]?\d+)\}?)?")


def _decimal_gold(s):
    """(value, half unit of the last digit) if `s` is a rounded decimal (docstring, point 2), else None."""
    m = _DECIMAL.fullmatch(re.sub(r"\s+", "", s)) if len(s) < 60 else None
    if not m or not (m.group(1) or m.group(2)):
        return None
    whole, frac, exp = m.group(1), m.group(2) or "", int(m.group(3) or m.group(4) or 0)
    sci = m.group(3) is not None or m.group(4) is not None
    if len((whole + frac).lstrip("0")) < 2 or not (sci or frac.strip("0")):
        return None
    value = sp.Rational(int(whole + frac), 10 ** len(frac)) * sp.Rational(10) ** exp
    half = sp.Rational(5, 10 ** (len(frac) + 1)) * sp.Rational(10) ** exp
    return (-value if s.lstrip().startswith("-") else value), half


# ------------------------------------------------------------------------------------------------ parser
Seq = namedtuple("Seq", "kind items")  # kind: "()" "[]" "(]" "[)" tuples/intervals, "{}" set, "mat" matrix rows
Eqn = namedtuple("Eqn", "lhs rhs named")  # named: the left side is a name (x, AB, y_1, f(x)), so x=5 also means 5
Rel = namedtuple("Rel", "expr strict")  # expr > 0 (strict) or expr >= 0, for relations that are not an interval

_TOKEN = re.compile(r"\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\\[a-zA-Z]+|\\[{}|]|[a-zA-Z]+|"
                    r"<=|>=|!=|[-+*/^_()\[\]{}=<>!|,;:&])")
_FUNCS = {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec, "csc": sp.csc,
          "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan, "sinh": sp.sinh, "cosh": sp.cosh,
          "tanh": sp.tanh, "exp": sp.exp, "ln": sp.log, "log": sp.log}
_CONSTS = {"pi": sp.pi, "infty": sp.oo, "infinity": sp.oo, "inf": sp.oo, "emptyset": sp.EmptySet, "reals": sp.Reals}
_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "ln", "log", "exp", "sqrt", "pi",
          "inf", "infinity", "and", "or"}  # words read as one token; other words are letters (xy = x*y) or text
_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma "
             "tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split())
_RELOPS = {"=": "=", "\\approx": "~", "<": "<", "\\lt": "<", ">": ">", "\\gt": ">", "<=": "<=", "\\le": "<=",
           "\\leq": "<=", "\\leqslant": "<=", ">=": ">=", "\\ge": ">=", "\\geq": ">=", "\\geqslant": ">=",
           "\\in": "in", "\\ne": "!=", "\\neq": "!=", "!=": "!="}
_SEPARATORS = {",", ";", "and", "or"}
_LETTERS = r"(?:[a-zA-Z]|\\[a-zA-Z]+)+(?:_(?:\{[^{}]*\}|\w))?"  # x, AB, y_1, \theta, S_{MBCN}
# a name as the left side of an answer (x, f(x), a length |AB|, \frac{NO}{BO}): x = 5 also means 5
_NAME = re.compile(rf"{_LETTERS}(?:\([^()+\-*/^]*\))?|\|[A-Z]{{2,}}\||\\frac\{{{_LETTERS}\}}\{{{_LETTERS}\}}")


def _tokenize(s):
    tokens, i, s = [], 0, s.rstrip()
    while i < len(s):
        m = _TOKEN.match(s, i)
        if not m:
            raise Refused(f"unexpected character {s[i]!r}")
        tok, i = m.group(1), m.end()
        if tok[0].isalpha() and tok not in _WORDS:
            if len(tok) > 3 and tokens[-2:] != ["_", "{"]:  # S_{MBCN} is a name
                raise Refused(f"word {tok!r}")  # text, not math: compared as a string only
            tokens.extend(tok)  # xy = x*y
        else:
            tokens.append(tok)
        if len(tokens) > MAX_TOKENS:
            raise Refused("too many tokens")
    return tokens


def _check(v):
    """Refuse exact numbers beyond MAX_BITS and undefined values (1/0)."""
    if v.has(sp.zoo, sp.nan):
        raise Refused("undefined value")
    if v.is_Rational and max(abs(v.p).bit_length(), v.q.bit_length()) > MAX_BITS:
        raise Refused("number too large")
    return v


def _magnitude(v):
    """|v| as a float with every symbol set to 1 (inf when it cannot be evaluated)."""
    try:
        return abs(complex(sp.N(v.subs({s: 1 for s in v.free_symbols}), 15)))
    except (TypeError, ValueError, OverflowError):
        return float("inf")


def _pow(b, e):
    if b.is_number and e.is_number:
        if b.is_Rational and e.is_Integer:  # exact: refuse results over MAX_BITS before computing them
            bits = max(abs(b.p).bit_length(), b.q.bit_length())
            if bits > 1 and abs(int(e)) * bits > MAX_BITS:
                raise Refused("power too large")
        elif not _magnitude(e) * abs(math.log(_magnitude(b) or 1.0)) <= MAX_LOG_MAGNITUDE:
            raise Refused("power too large")
    elif e.is_Integer and abs(int(e)) > MAX_SYMBOLIC_EXPONENT:
        raise Refused("exponent too large")
    elif any(isinstance(n, sp.Pow) and n.exp.free_symbols for n in sp.preorder_traversal(e)):
        raise Refused("power tower")
    return _check(sp.Pow(b, e))


class _Parser:
    """Recursive descent over the tokens. Grammar (loosest first):
    items := relation (sep relation)* ; relation := setexpr (relop setexpr)* ; setexpr := sum (\\cup sum)* ;
    sum := [+-] term ([+-] term)* ; term := power ((* / \\cdot \\times \\div | implicit) power)* ;
    power := postfix [^ arg] ; postfix := primary [!]* ; primary := number | letter | command | group."""

    def __init__(self, text, deadline):
        self.toks, self.i, self.depth, self.deadline = _tokenize(text), 0, 0, deadline

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected=None):
        _tick(self.deadline)
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise Refused(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def skip(self, tok):
        """Take `tok` if it comes next."""
        return self.peek() == tok and bool(self.take())

    def parse(self):
        items = self.items()
        if self.peek() is not None:
            raise Refused(f"unexpected {self.peek()!r}")
        return items

    def items(self, separators=_SEPARATORS):
        items = [self.relation()]
        while self.peek() in separators:
            while self.peek() in separators:  # "19, 46, and 82"
                self.take()
            items.append(self.relation())
        return items

    def relation(self):
        start = self.i
        sides, ops = [self.ratio()], []
        spans = [(start, self.i)]  # the tokens of each side
        while self.peek() in _RELOPS:
            ops.append(_RELOPS[self.take()])
            start = self.i
            sides.append(self.ratio())
            spans.append((start, self.i))
        named = [bool(_NAME.fullmatch("".join(self.toks[a:b]))) for a, b in spans]
        if ops[:1] == ["~"] and named[0] and isinstance(sides[0], sp.Expr) and sides[0].free_symbols:
            # x \approx 11: the value stated, as x = 11 (\pi \approx 3.14 stays \pi)
            sides, ops = sides[:2], ["="]
        elif "~" in ops:  # x = 5\sqrt{2} \approx 7.07: what comes after the first \approx is only an approximation
            sides, ops = sides[: ops.index("~") + 1], ops[: ops.index("~")]
        if not ops:
            return sides[0]
        if ops == ["in"]:
            return _as_set(sides[1])
        if set(ops) == {"="}:
            lhs, rhs = sides[0], sides[-1]
            if len(sides) == 2 and named[1] and not named[0] and isinstance(lhs, sp.Expr) and not lhs.free_symbols:
                lhs, rhs, named = rhs, lhs, named[::-1]  # 2 = x: the value on the left
            if len(sides) > 2 or not (isinstance(rhs, sp.Expr) and isinstance(lhs, sp.Expr)) or not (
                    lhs.free_symbols or rhs.free_symbols):
                return rhs  # x = 2 + 3 = 5, 6/8 = 3/4, (a, b) = (1, 2), S_1:S = 7:32, A:B = 1: the last side
            return Eqn(lhs, rhs, named[0])
        try:
            return _interval(sides, ops, named)
        except Refused:
            if len(ops) != 1 or ops[0] not in ("<", "<=", ">", ">="):
                raise
            big, small = sides if ops[0][0] == ">" else sides[::-1]
            return Rel(big - small, len(ops[0]) == 1)

    def ratio(self):
        """a : b : c (7:32, 12:00), compared term by term."""
        items = [self.setexpr()]
        while self.skip(":"):
            items.append(self.setexpr())
        return items[0] if len(items) == 1 else Seq(":", tuple(items))

    def setexpr(self):
        value = self.sum()
        while self.peek() in ("\\cup", "\\cap", "\\setminus"):
            op, left, right = self.take(), _as_set(value), _as_set(self.sum())
            value = {"\\cup": sp.Union, "\\cap": sp.Intersection, "\\setminus": sp.Complement}[op](left, right)
        return value

    def sum(self):
        negative = self.peek() == "-"
        if self.peek() in ("+", "-"):
            self.take()
        value = _check(-self.term()) if negative else self.term()
        while self.peek() in ("+", "-"):
            value = _check(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self):
        value = self.power()
        while True:
            if self.peek() in ("*", "\\cdot", "\\times") and self.take() or self._starts_factor(self.peek()):
                value = _check(value * self.power())
            elif self.peek() in ("/", "\\div") and self.take():
                value = _check(value / self.power())
            elif self.skip("\\bmod"):  # 17 \bmod 5
                value = _check(sp.Mod(value, self.power()))
            else:
                return value

    def _starts_factor(self, tok):
        """Implicit multiplication (2x, 3(x+1), 2\\pi, x\\sqrt{2}); a number only after a non-number (12 34: none)."""
        if tok is None or tok in _SEPARATORS:
            return False
        if tok[0].isdigit():
            return not self.toks[self.i - 1][0].isdigit()
        name = tok[1:] if tok[0] == "\\" else None
        return tok[0].isalpha() or tok in ("(", "\\lfloor", "\\lceil", "\\frac", "\\sqrt", "\\binom") or (
            name in _FUNCS or name in _CONSTS or name in _GREEK)

    def power(self):
        base = self.postfix()
        return _pow(base, self.arg(signed=True)) if self.skip("^") else base

    def postfix(self):
        value = self.primary()
        while self.skip("!"):
            if not (value.free_symbols or value.is_Integer and 0 <= value <= MAX_FACTORIAL):
                raise Refused("factorial")
            value = _check(sp.factorial(value))
        return value

    def arg(self, signed=False):
        """A command argument: {group} or one token (x^-1, x^10, and \\frac1{2} reads one digit)."""
        tok = self.peek()
        if signed and tok in ("-", "+") and self.take():
            return -self.arg() if tok == "-" else self.arg()
        if tok is not None and tok.isdigit() and len(tok) > 1 and not signed:
            self.toks[self.i : self.i + 1] = [tok[0], tok[1:]]
        return self.postfix()

    def primary(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refused("nesting too deep")
        value = self._primary(self.take())
        self.depth -= 1
        return value

    def _primary(self, tok):
        name = tok.lstrip("\\")
        if tok[0].isdigit() or tok[0] == ".":
            return _number(tok)
        if name in _FUNCS:
            return self.function(name)
        if name in _CONSTS:
            return _CONSTS[name]
        if name == "sqrt":  # \sqrt{x}, \sqrt[3]{x}
            index = self.sum() if self.skip("[") else None
            if index is not None:
                self.take("]")
            radicand = self.arg()
            return _check(sp.sqrt(radicand)) if index is None else _pow(radicand, 1 / index)
        if tok == "\\frac":
            return _check(self.arg() / self.arg())
        if tok == "\\binom":
            n, k = self.arg(), self.arg()
            if not (n.free_symbols or k.free_symbols or n.is_Integer and k.is_Integer and 0 <= n <= MAX_FACTORIAL):
                raise Refused("binomial")
            return _check(sp.binomial(n, k))
        if (len(tok) == 1 and tok.isalpha()) or name in _GREEK or name == "angle":  # \angle APC: a name
            return self.symbol(name)
        if tok in ("(", "["):
            items = self.items(separators={",", ";"})  # (0;0;0): a tuple
            close = self.take()
            if close not in (")", "]"):
                raise Refused("bracket")
            if len(items) == 1 and tok + close in ("()", "[]"):
                return items[0]  # grouping
            return Seq(tok + close, tuple(items))
        if tok == "{":
            items = self.items()
            if self.skip("\\over"):  # {3 \over 4}
                items = [_check(items[0] / self.sum())]
            self.take("}")
            return items[0] if len(items) == 1 else Seq("{}", tuple(items))
        if tok == "\\{":
            items = [] if self.peek() == "\\}" else self.items(separators={","})
            self.take("\\}")
            return Seq("{}", tuple(items))
        if tok in ("|", "\\lfloor", "\\lceil"):  # |x|, floor, ceiling
            value = self.sum()
            self.take({"|": "|", "\\lfloor": "\\rfloor", "\\lceil": "\\rceil"}[tok])
            return {"|": sp.Abs, "\\lfloor": sp.floor, "\\lceil": sp.ceiling}[tok](value)
        if tok == "\\matbegin":
            rows = [self.items(separators={"&"})]
            while self.skip("\\rowsep"):
                if self.peek() != "\\matend":
                    rows.append(self.items(separators={"&"}))
            self.take("\\matend")
            return Seq("mat", tuple(Seq("()", tuple(r)) for r in rows))
        raise Refused(f"unexpected {tok!r}")

    def symbol(self, name):
        if self.skip("_"):  # x_1, a_{n}: one symbol
            sub = [self.take()]
            while sub[0] == "{" and sub[-1] != "}":
                sub.append(self.take())
            name += "_" + "".join(sub).strip("{}")
        return {"i": sp.I, "e": sp.E}.get(name) or sp.Symbol(name)

    def function(self, name):
        """\\sin x, \\sin^2 x, \\log_2 8, \\ln(x+1), \\sin 2x \\cos x: the argument is a product of plain factors."""
        base = self.arg() if name == "log" and self.skip("_") else None
        exponent = self.arg(signed=True) if self.skip("^") else None
        grouped = self.peek() in ("(", "{")
        arg = self.postfix() if grouped else self.power()  # \sin(x)^2 = (\sin x)^2, \sin x^2 = \sin(x^2)
        while not grouped and self._starts_factor(self.peek()) and self.peek().lstrip("\\") not in _FUNCS:
            arg = _check(arg * self.power())
        if name in ("exp", "sinh", "cosh", "tanh"):
            _pow(sp.E, arg)  # the same size guard as e^{...}
        elif name not in ("ln", "log") and _magnitude(arg) > MAX_TRIG_ARGUMENT:
            raise Refused("trigonometric argument too large")
        if exponent == -1 and name in ("sin", "cos", "tan"):  # \sin^{-1} x = arcsin x
            name, exponent = "arc" + name, None
        value = _check(sp.log(arg, base) if base is not None else _FUNCS[name](arg))
        return _pow(value, exponent) if exponent is not None else value


def _number(tok):
    m = re.fullmatch(r"(\d*)\.?(\d*)(?:[eE]([+-]?\d+))?", tok)
    whole, frac, exp = m.group(1), m.group(2), int(m.group(3) or 0)
    if len(whole) + len(frac) > MAX_DIGITS or abs(exp) > 1000:
        raise Refused("number too long")
    return sp.Rational(int(whole + frac or "0"), 10 ** len(frac)) * sp.Rational(10) ** exp


def _as_set(v):
    """Sets for \\cup, \\in and comparisons: {..} -> FiniteSet, a 2-element bracket pair -> Interval."""
    if isinstance(v, sp.Set):
        return v
    if isinstance(v, Seq) and v.kind == "{}" and all(isinstance(x, sp.Expr) for x in v.items):
        return sp.FiniteSet(*v.items)
    if isinstance(v, Seq) and v.kind in ("()", "[]", "(]", "[)") and len(v.items) == 2:
        lo, hi = v.items
        if isinstance(lo, sp.Expr) and isinstance(hi, sp.Expr) and not (lo.free_symbols or hi.free_symbols):
            return sp.Interval(lo, hi, v.kind[0] == "(", v.kind[1] == ")")
    raise Refused("not a set")


def _interval(sides, ops, named):
    """0 < x <= 5, x >= 3, 5 > x, x != 1, -x > -1, |x - 3| < 2, 0 < f(x) < 1: the set of the one variable (its name
    is dropped, like x = 5 -> 5). The varying side is a symbol, a name of several letters (f(x), |AB|: the set of its
    values) or an expression of one symbol for _preimage (the set of that symbol)."""
    varying = [k for k, side in enumerate(sides) if not isinstance(side, sp.Expr) or side.free_symbols]
    if len(varying) != 1 or not isinstance(sides[varying[0]], sp.Expr) or {"=", "in"} & set(ops):
        raise Refused("relation")
    k = varying[0]
    var = sides[k]
    if ops == ["!="] and isinstance(var, sp.Symbol):
        return sp.Complement(sp.Reals, sp.FiniteSet(sides[1 - k]))
    if "!=" in ops or any(j not in (k - 1, k) for j in range(len(ops))):  # 1 < 2 < x: a side without the variable
        raise Refused("relation")
    lo, hi, lo_open, hi_open = -sp.oo, sp.oo, True, True
    for j, op in enumerate(ops):
        bound = sides[j] if j == k - 1 else sides[j + 1]
        if j == k - 1:  # a < x  ->  x > a
            op = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}[op]
        if op in ("<", "<="):
            hi, hi_open = bound, op == "<"
        else:
            lo, lo_open = bound, op == ">"
    values = sp.Interval(lo, hi, lo_open, hi_open)
    if isinstance(var, sp.Symbol) or named[k] and len(var.free_symbols) > 1:
        return values
    return _preimage(var, values)


def _preimage(expr, values):
    """The set of the one symbol x of `expr` where `expr` takes `values` (an interval or a union of intervals), for
    `expr` affine in x or in one |u| with u of the same kind: -x > -1 -> x < 1, 1 <= |z| <= 3/2 -> [-3/2,-1] U [1,3/2].
    Anything else is refused."""
    if len(expr.free_symbols) != 1:
        raise Refused("relation")
    (x,) = expr.free_symbols
    for _ in range(MAX_DEPTH):
        absolutes = expr.atoms(sp.Abs)
        inner = absolutes.pop() if len(absolutes) == 1 else x
        t = sp.Dummy()
        affine = expr.subs(inner, t)
        a, b = affine.diff(t), affine.subs(t, 0)
        if absolutes or a.free_symbols or b.free_symbols or not (a.is_real and a.is_nonzero):
            raise Refused("relation")
        pieces = []  # {(y - b) / a : y in values}
        for v in values.args if isinstance(values, sp.Union) else [values]:
            ends = ((v.start - b) / a, (v.end - b) / a, v.left_open, v.right_open)
            pieces.append(sp.Interval(*ends) if a.is_positive else sp.Interval(ends[1], ends[0], ends[3], ends[2]))
        values = sp.Union(*pieces)
        if inner == x:
            return values
        values = sp.Intersection(values, sp.Interval(0, sp.oo))  # |u| in values  <->  u in values or -values
        values = sp.Union(values, sp.Union(*[sp.Interval(-v.end, -v.start, v.right_open, v.left_open)
                                             for v in (values.args if isinstance(values, sp.Union) else [values])
                                             if isinstance(v, sp.Interval)]))
        expr = inner.args[0]
    raise Refused("relation")


def _parse(text, deadline):
    """All answers in `text` as a list of values; one \\pm makes two answers."""
    if len(text) > MAX_ANSWER_CHARS:
        raise Refused("answer too long")
    variants = [text]
    if text.count("\\pm") + text.count("\\mp") == 1:
        variants = [re.sub(r"\\[pm]{2}", "+", text), re.sub(r"\\[pm]{2}", "-", text)]
    try:
        return [item for v in variants for item in _Parser(v, deadline).parse()]
    except Refused:
        last = text.rsplit("=", 1)[-1]  # \lim_{x \to 0} \frac{\sin x}{x} = 1: a left side it cannot read, a value
        words = re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}", text)  # not "f(x) = 3 \text{ when } x = 5"
        readable = "=" in text and not re.search(r"[,;]|\\pm", text) and all(w in _WORDS for w in words)
        items = _Parser(last, deadline).parse() if readable else []
        if len(items) == 1 and isinstance(items[0], sp.Expr) and not items[0].free_symbols:
            return items
        raise


# ------------------------------------------------------------------------------------------------ comparison
def _is_zero(v):
    """sympy's evalf returns a precision-less 0.e-160 for an exact zero it cannot simplify (1/(2-sqrt3) - (2+sqrt3))
    and an accurate value for a tiny nonzero one (2^-2006), so this is an exact test up to ~160 digits."""
    return all(p == 0 or (p.is_Float and p._prec <= 1) for p in sp.N(v, 30).as_real_imag())


def _at_points(exprs, deadline):
    """The values of `exprs` at three rational points of their symbols, to 50 digits (evalf: the exact values of
    (x+y+1)^2500 would cost seconds of gcd)."""
    symbols = sorted(set().union(*(e.free_symbols for e in exprs)), key=str)
    for p, q in ((7, 19), (13, 29), (31, 11)):
        _tick(deadline)
        yield [e.evalf(50, subs={s: sp.Rational(p + 2 * k, q) for k, s in enumerate(symbols)}) for e in exprs]


def _close(x, y):
    """Two evaluated numbers agree to 30 significant digits."""
    finite = all(v.is_number and not v.has(sp.nan, sp.zoo, sp.oo, -sp.oo) for v in (x, y))
    return finite and bool(abs(x - y) <= sp.Float("1e-30") * max(abs(x), abs(y)))


def _same_expr(a, b, deadline):
    _tick(deadline)
    if a == b:
        return True
    if a.is_Rational and b.is_Rational or a.has(sp.oo, -sp.oo, sp.zoo) or b.has(sp.oo, -sp.oo, sp.zoo):
        return False
    if not (a.free_symbols or b.free_symbols):
        return _is_zero(a - b)
    return all(_close(va, vb) for va, vb in _at_points([a, b], deadline))  # an identity: equal at three points


def _constant_ratio(a, b, deadline):
    """a / b when it is the same nonzero constant at three points (one equation or relation up to a factor)."""
    values = list(_at_points([a, b], deadline))
    if any(not (va.is_number and vb.is_number) or abs(va) < 1e-40 or abs(vb) < 1e-40 for va, vb in values):
        return None
    ratio = values[0][0] / values[0][1]
    return ratio if all(_close(va / vb, ratio) for va, vb in values[1:]) else None


def _set_parts(s):
    out = []
    for p in s.args if isinstance(s, sp.Union) else [s]:
        if isinstance(p, sp.FiniteSet):
            out.extend(p.args)
        elif isinstance(p, sp.Interval):
            out.append(Seq(("(" if p.left_open else "[") + (")" if p.right_open else "]"), (p.start, p.end)))
        elif p is not sp.EmptySet:
            raise Refused("set")
    return out


def _same(p, g, deadline):
    """One predicted value against one gold value."""
    _tick(deadline)
    if isinstance(p, Eqn) and isinstance(g, Eqn):  # same names: same right sides; else proportional equations
        if p.named and g.named and p.lhs == g.lhs:
            return _same_expr(p.rhs, g.rhs, deadline)
        return _constant_ratio(p.lhs - p.rhs, g.lhs - g.rhs, deadline) is not None
    if isinstance(p, Eqn) or isinstance(g, Eqn):  # x = 5 against 5
        return p.named and _same(p.rhs, g, deadline) if isinstance(p, Eqn) else g.named and _same(p, g.rhs, deadline)
    if isinstance(p, Rel) and isinstance(g, Rel):
        ratio = _constant_ratio(p.expr, g.expr, deadline)
        return p.strict == g.strict and ratio is not None and bool(sp.re(ratio) > 0)
    if isinstance(p, sp.Set) or isinstance(g, sp.Set):
        try:
            return _match(_set_parts(_as_set(p)), _set_parts(_as_set(g)), deadline)
        except Refused:
            return False
    if isinstance(p, Seq) and isinstance(g, Seq):
        if p.kind != g.kind or len(p.items) != len(g.items):
            return False
        if p.kind == "{}":
            return _match(list(p.items), list(g.items), deadline)
        return all(_same(a, b, deadline) for a, b in zip(p.items, g.items))
    return isinstance(p, sp.Expr) and isinstance(g, sp.Expr) and _same_expr(p, g, deadline)


def _match(preds, golds, deadline):
    """Unordered one-to-one match of two lists of answers."""
    if len(preds) != len(golds):
        return False
    left, rest = list(preds), []
    for g in golds:  # identical values first: cheap, and spares the numeric tests
        _tick(deadline)
        if g in left:
            left.remove(g)
        else:
            rest.append(g)
    for g in rest:
        hit = next((k for k, p in enumerate(left) if _same(p, g, deadline)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def _disjoint(sets, deadline):
    for k, a in enumerate(sets):
        for b in sets[:k]:
            _tick(deadline)
            if sp.Intersection(a, b) is not sp.EmptySet:
                return False
    return True


def _shape(items, other, deadline):
    """Bring a list of answers to the other side's shape: x<-1 or x>2 -> one set; {1, 2} -> the answers 1, 2;
    x = 1, y = 2 (or 1, 2) -> the tuple (1, 2)."""
    if len(items) > 1 and all(isinstance(v, sp.Set) for v in items):  # disjoint: "or"; overlapping: "and"
        return [sp.Union(*items) if _disjoint(items, deadline) else sp.Intersection(*items)]
    if len(items) == 1 and len(other) > 1 and isinstance(items[0], sp.FiniteSet):
        return list(items[0].args)
    if len(items) == 1 and len(other) > 1 and isinstance(items[0], Seq) and items[0].kind == "{}":
        return list(items[0].items)
    if len(other) == 1 and isinstance(other[0], Seq) and other[0].kind in ("()", "[]") and len(items) == len(
            other[0].items) > 1 and all(isinstance(v, sp.Expr) or isinstance(v, Eqn) and v.named for v in items):
        return [Seq(other[0].kind, tuple(v.rhs if isinstance(v, Eqn) else v for v in items))]  # 3, 4 in order
    return items


# a multiple-choice answer: the letter alone ("C", "(C)", "C)") or with its label text ("(C) 12", "C. x = 42")
_CHOICE = re.compile(r"\(?([A-E])\)?|(?:\(([A-E])\)|([A-E])[.:)](?=\s))\s*([^\s=+\-*/^<>!_,;].*)")
_CHOICE_GOLD = re.compile(r"()()([A-E])\s+([A-Z][a-z]+\b.*)", re.DOTALL)  # "C Cecile"; not "A triangle"
_OTHER_CHOICE = re.compile(r"(?<![\w\\])[A-E](?!\w)|\b(?:or|and)\b")  # in label text: a hedge or a second choice


def _choice(s, gold=False):
    """(letter, label text or "") of a multiple-choice answer, else None; a gold may also be "C Cecile" (a letter, a
    space and a capitalized name)."""
    m = _CHOICE.fullmatch(s) or gold and _CHOICE_GOLD.fullmatch(s)
    return (m.group(1) or m.group(2) or m.group(3), (m.group(4) or "").strip()) if m else None


def _same_choice(pred, gold, deadline):
    """A choice gold accepts its letter, alone or with its own label text (any label text for a bare-letter gold), or
    that label text alone; never more math after the letter ("E+1", "B = 7") or a second choice ("B, C", "B or C")."""
    letter, text = gold
    choice = _choice(pred)
    if choice is None:  # the gold's label text alone: "x = 42" for "C. x = 42"
        return bool(text) and not _OTHER_CHOICE.search(text) and _equivalent(pred, [text], deadline)
    if choice[0] != letter or _OTHER_CHOICE.search(choice[1]):
        return False
    return not (choice[1] and text) or _equivalent(choice[1], [text], deadline)


def _equivalent(pred, golds, deadline):
    if len(pred) > 10 * MAX_ANSWER_CHARS:
        return False  # not a final answer
    try:
        (p, p_pct), cleaned = _clean(pred, deadline), [_clean(g, deadline) for g in golds]
        g = ", ".join(c for c, _ in cleaned)
        if not p:
            return False
        if not re.search(r",|;|\b(?:and|or)\b", g) and re.fullmatch(r"-?\d+,\d+", p):  # 2,74 for a one-number gold
            p = p.replace(",", ".")  # a decimal comma
        if _squash(p) == _squash(g):
            return True
        choice = _choice(g, gold=True)
        if choice:
            return _same_choice(p, choice, deadline)
        p_items, g_items = _parse(p, deadline), _parse(g, deadline)
        p_items, g_items = _shape(p_items, g_items, deadline), _shape(g_items, p_items, deadline)
        if len(p_items) != len(g_items):  # the same answer twice ("x+11 or 11+x") is not a hedge, nor two golds
            p_items, g_items = ([v for k, v in enumerate(items) if not any(_same(v, u, deadline) for u in items[:k])]
                                for items in (p_items, g_items))
        if _match(p_items, g_items, deadline):
            return True
        if len(p_items) != 1 or len(g_items) != 1 or not isinstance(p_items[0], sp.Expr):
            return False
        value = p_items[0]
        scaled = value / 100 if p_pct else value * 100  # 25% = 0.25
        if p_pct != any(pct for _, pct in cleaned) and _same(scaled, g_items[0], deadline):
            return True
        approx = _decimal_gold(g)
        if approx and value.is_number and not _DECIMAL.fullmatch(re.sub(r"\s+", "", p)):
            _tick(deadline)
            diff = sp.N(value - approx[0], 30)  # not sp.Abs(...): its sign test on a long sum took 0.5 s
            return bool(diff.is_real and abs(diff) < approx[1])
        return False
    except Exception:  # Refused, or anything sympy raises on a strange answer: not equivalent, never a crash
        return False
