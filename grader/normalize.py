"""An answer's text cleaned for parsing (docs/grader.md): LaTeX wrappers, units, layout and spacing
removed, \\dfrac and friends unified, percent, repeating decimals and matrices rewritten; `squash`
for the string match (--reward strict); `decimal_gold` for the one tolerance (docs/paper.md,
"Deliberate differences": D12)."""
import re

import sympy as sp

from grader.extraction import PHRASE, find_boxes, from_boxes, from_phrase
from grader.limits import MAX_ANSWER_CHARS, tick

# ------------------------------------------------------------------------------------ normalization
_REPLACE = [("\\\\", " \\rowsep "), ("**", "^"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
            ("\\cfrac", "\\frac"), ("\\displaystyle", ""), ("\\textstyle", ""), ("\\!", ""),
            ("\\,", " "), ("\\;", " "), ("\\:", " "), ("~", " "), ("\\qquad", " "), ("\\quad", " "),
            ("\\$", ""), ("$", " "), ("\\(", ""), ("\\)", ""), ("€", ""), ("£", ""), ("¥", ""),
            ("\\varnothing", "\\emptyset"), ("−", "-"), ("×", "\\times "), ("÷", "\\div "),
            ("≤", "\\le "), ("≥", "\\ge "), ("≠", "\\ne "), ("≈", "\\approx "), ("∞", "\\infty "),
            ("π", "\\pi "), ("√", "\\sqrt "), ("°", ""), ("\\degree", ""), ("\\mbox", "\\text"),
            ("\\dbinom", "\\binom"), ("\\tbinom", "\\binom"), ("\\langle", "("), ("\\rangle", ")"),
            ("\\mathbb{R}", "\\reals"), ("\\lvert", "|"), ("\\rvert", "|"), ("\\vert", "|"),
            ("\\mid", "|")]


_WRAPPERS = (r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|mathrm|mathbf|mathit|mathsf|"
             r"mathtt|boldsymbol|operatorname|underline|emph|bf|rm)")


_UNWRAP = re.compile(_WRAPPERS + r"\s*\{")


_UNIT = re.compile(r"(?<=[\d}).!])\s*" + _WRAPPERS +
                   r"\s*\{\s*(?!and\b|or\b)[a-zA-Z][a-zA-Z ./]*\}(\s*\^\s*\{?\d\}?)?")


_UNIT_WORDS = re.compile(r"(?:(?<=[\d}])|(?<=\\pi))\s+(?!and\b|or\b)[a-zA-Z]{2,}\.?"
                         r"(?:\s+[a-zA-Z]{2,}\.?)*(\s*\^\s*\{?\d\}?)?$")


# sizes, colors, spaces
_DROP = re.compile(r"\\(?:left|right|[bB]igg?[lr]?|tiny|small|normalsize|large|Large|LARGE|huge|"
                   r"Huge)(?![a-zA-Z])|\\(?:text)?color\s*\{[^{}]*\}|\\hspace\*?\{[^{}]*\}")


_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")


_PERCENT = re.compile(r"\\?%|\bpercent\b")


_MATRIX = [(re.compile(r"\\begin\{array\}\{[^{}]*\}|\\begin\{[pbvBV]?matrix\}"), " \\matbegin "),
           (re.compile(r"\\end\{array\}|\\end\{[pbvBV]?matrix\}"), " \\matend ")]


def _repeating(m):  # 0.1\overline{6} -> (15/90)
    whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3)
    return (f"({int(whole + fixed + period) - int(whole + fixed)}/"
            f"{10 ** len(fixed) * (10 ** len(period) - 1)})")


def _closing(s, start):
    """Index of the brace that closes the one at s[start], or None."""
    depth = 0
    for k in range(start, len(s)):
        depth += {"{": 1, "}": -1}.get(s[k], 0)
        if depth == 0:
            return k
    return None


def _unwrap(s, deadline, limit=20):
    """\\text{...}, \\mathbf{\\frac{1}{2}}, ...: keep the content; also drop redundant outer braces
    ({5}, {{5}})."""
    for _ in range(limit):
        tick(deadline)
        m = _UNWRAP.search(s)
        end = _closing(s, m.end() - 1) if m else None
        if end is None:
            break
        s = s[: m.start()] + s[m.end() : end] + s[end + 1 :]
    for _ in range(3):
        # {3 \over 4} is a fraction
        if not s.startswith("{") or _closing(s, 0) != len(s) - 1 or "\\over" in s:
            break
        s = s[1:-1].strip()
    return s


def clean_answer(s, deadline):
    """String-level normalization of one answer -> (text, had a percent sign)."""
    s = re.sub(r"(?<!\\)\\(?=\s|$)", " ", s).strip()  # "\ " (a space), also at the end: 185\
    if "####" in s:  # a GSM8K solution as gold
        s = s.rsplit("####", 1)[1]
    # a full solution as gold: its last box, or the boxes joined to it
    if "\\boxed" in s or "\\fbox" in s:
        boxes = find_boxes(s, deadline)
        s = (boxes[-1][2] and from_boxes(s, boxes, deadline)) or \
            next((c for _, _, c in reversed(boxes) if c), s)
    # "Alina and the answer is\n(C) Cecile"
    elif ("\n" in s.strip() or len(s) > 200) and PHRASE.search(s):
        s = from_phrase(s) or s
    if "\\begin" not in s:
        # \\dfrac (escaped twice) is \dfrac, outside a matrix
        s = re.sub(r"\\\\(?=[a-zA-Z])", r"\\", s)
    if len(s) > 10 * MAX_ANSWER_CHARS:
        return s, False  # not a final answer: left as it is
    # 111,\!111 and 14 {, }916: a thousands separator
    s = re.sub(r",\s*\\!\s*|\s*\{\s*,\s*\}\s*", ",", s)
    for a, b in _REPLACE:
        s = s.replace(a, b)
    s = _DROP.sub("", s)
    s = re.sub(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+", lambda m: "^{%s}" % m.group().translate(_SUPERSCRIPTS), s)  # 10⁻⁵
    # degrees (a space: 45^\circ,135^\circ is a list)
    s = re.sub(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ\b", " ", s)
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
    # base subscript: (1011)_2 -> 1011
    s = re.sub(r"(?<![A-Za-z\d_])\(?(\d+)\)?_\{?\(?\d+\)?\}?", r"\1", s)
    s = re.sub(r"(\d{0,50})\.(\d{0,50})\\overline\s*\{(\d{1,50})\}", _repeating, s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)|\\frac\s*(\{[^{}]*\})\s*(\d)", lambda m: "\\frac{%s}{%s}" % (
        m.group(1) or m.group(3).strip("{}"), m.group(2) or m.group(4)), s)  # \frac12, \frac{x}2
    # 2\frac13
    s = re.sub(r"(?<![\d.}^_a-zA-Z\\])(\d+)\s*\\frac\s*\{(\d+)\}\s*\{(\d+)\}", r"(\1+\2/\3)", s)
    s = re.sub(r"^(\d+) (\d+)/(\d+)$", r"(\1+\2/\3)", s)  # 2 1/3
    s = re.sub(r"(\d)\s*[x*]\s*10\^", r"\1\\times 10^", s)  # 3.2 x 10^5
    if re.fullmatch(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?|"
                    r"[+-]?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?", s):  # 1,234
        s = s.replace(",", "").replace(" ", "")
    return s, percent


def squash(s):
    s = re.sub(r"\s+", "", s)
    return s.lower() if re.fullmatch(r"[A-Za-z]{2,}", s) else s


DECIMAL = re.compile(r"[+-]?(\d*)(?:\.(\d*))?(?:e([+-]?\d+)|\\(?:times|cdot)10\^\{?([+-]?\d+)\}?)?")


def decimal_gold(s):  # the one tolerance (D12)
    """(value, half unit of the last digit) if `s` is a rounded decimal (docstring, point 2), else
    None."""
    m = DECIMAL.fullmatch(re.sub(r"\s+", "", s)) if len(s) < 60 else None
    if not m or not (m.group(1) or m.group(2)):
        return None
    whole, frac, exp = m.group(1), m.group(2) or "", int(m.group(3) or m.group(4) or 0)
    sci = m.group(3) is not None or m.group(4) is not None
    if len((whole + frac).lstrip("0")) < 2 or not (sci or frac.strip("0")):
        return None
    value = sp.Rational(int(whole + frac), 10 ** len(frac)) * sp.Rational(10) ** exp
    half = sp.Rational(5, 10 ** (len(frac) + 1)) * sp.Rational(10) ** exp
    return (-value if s.lstrip().startswith("-") else value), half
