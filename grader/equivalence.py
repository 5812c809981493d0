"""Whether a predicted answer equals the gold (docs/grader.md): parsed values compared exactly
(sympy Rationals), expressions at points and symbolically, tuples, sets and intervals part by part,
equations by their value, multiple choice by its letter, a gold of several answers against one box
per part (`answer_parts`) (docs/paper.md, "Deliberate differences": D11-D13)."""
import re

import sympy as sp

from grader.extraction import HEDGE
from grader.limits import MAX_ANSWER_CHARS, Refused, tick
from grader.normalize import DECIMAL, clean_answer, decimal_gold, squash
from grader.parser import Eqn, Rel, Seq, as_set, parse_answer


# --------------------------------------------------------------------------------------- comparison
def _is_zero(v):
    """sympy's evalf returns a precision-less 0.e-160 for an exact zero it cannot simplify
    (1/(2-sqrt3) - (2+sqrt3)) and an accurate value for a tiny nonzero one (2^-2006), so this is an
    exact test up to ~160 digits."""
    return all(p == 0 or (p.is_Float and p._prec <= 1) for p in sp.N(v, 30).as_real_imag())


def _at_points(exprs, deadline):
    """The values of `exprs` at three rational points of their symbols, to 50 digits (evalf: the
    exact values of (x+y+1)^2500 would cost seconds of gcd)."""
    symbols = sorted(set().union(*(e.free_symbols for e in exprs)), key=str)
    for p, q in ((7, 19), (13, 29), (31, 11)):
        tick(deadline)
        yield [e.evalf(50, subs={s: sp.Rational(p + 2 * k, q) for k, s in enumerate(symbols)})
               for e in exprs]


def _close(x, y):
    """Two evaluated numbers agree to 30 significant digits."""
    finite = all(v.is_number and not v.has(sp.nan, sp.zoo, sp.oo, -sp.oo) for v in (x, y))
    return finite and bool(abs(x - y) <= sp.Float("1e-30") * max(abs(x), abs(y)))


def _same_expr(a, b, deadline):
    tick(deadline)
    if a == b:
        return True
    if a.is_Rational and b.is_Rational or a.has(sp.oo, -sp.oo, sp.zoo) or \
            b.has(sp.oo, -sp.oo, sp.zoo):
        return False
    if not (a.free_symbols or b.free_symbols):
        return _is_zero(a - b)
    # an identity: equal at three points
    return all(_close(va, vb) for va, vb in _at_points([a, b], deadline))


def _constant_ratio(a, b, deadline):
    """a / b when it is the same nonzero constant at three points (one equation or relation up to a
    factor)."""
    values = list(_at_points([a, b], deadline))
    if any(not (va.is_number and vb.is_number) or abs(va) < 1e-40 or abs(vb) < 1e-40
           for va, vb in values):
        return None
    ratio = values[0][0] / values[0][1]
    return ratio if all(_close(va / vb, ratio) for va, vb in values[1:]) else None


def _set_parts(s):
    out = []
    for p in s.args if isinstance(s, sp.Union) else [s]:
        if isinstance(p, sp.FiniteSet):
            out.extend(p.args)
        elif isinstance(p, sp.Interval):
            out.append(Seq(("(" if p.left_open else "[") + (")" if p.right_open else "]"),
                           (p.start, p.end)))
        elif p is not sp.EmptySet:
            raise Refused("set")
    return out


def _same(p, g, deadline):
    """One predicted value against one gold value."""
    tick(deadline)
    # same names: same right sides; else proportional equations
    if isinstance(p, Eqn) and isinstance(g, Eqn):
        if p.named and g.named and p.lhs == g.lhs:
            return _same_expr(p.rhs, g.rhs, deadline)
        return _constant_ratio(p.lhs - p.rhs, g.lhs - g.rhs, deadline) is not None
    if isinstance(p, Eqn) or isinstance(g, Eqn):  # x = 5 against 5
        return p.named and _same(p.rhs, g, deadline) if isinstance(p, Eqn) else \
            g.named and _same(p, g.rhs, deadline)
    if isinstance(p, Rel) and isinstance(g, Rel):
        ratio = _constant_ratio(p.expr, g.expr, deadline)
        return p.strict == g.strict and ratio is not None and bool(sp.re(ratio) > 0)
    if isinstance(p, sp.Set) or isinstance(g, sp.Set):
        try:
            return _match(_set_parts(as_set(p)), _set_parts(as_set(g)), deadline)
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
        tick(deadline)
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
            tick(deadline)
            if sp.Intersection(a, b) is not sp.EmptySet:
                return False
    return True


def _shape(items, other, deadline):
    """Bring a list of answers to the other side's shape: x<-1 or x>2 -> one set;
    {1, 2} -> the answers 1, 2; x = 1, y = 2 (or 1, 2) -> the tuple (1, 2)."""
    # disjoint: "or"; overlapping: "and"
    if len(items) > 1 and all(isinstance(v, sp.Set) for v in items):
        return [sp.Union(*items) if _disjoint(items, deadline) else sp.Intersection(*items)]
    if len(items) == 1 and len(other) > 1 and isinstance(items[0], sp.FiniteSet):
        return list(items[0].args)
    if len(items) == 1 and len(other) > 1 and isinstance(items[0], Seq) and items[0].kind == "{}":
        return list(items[0].items)
    if len(other) == 1 and isinstance(other[0], Seq) and other[0].kind in ("()", "[]") and \
            len(items) == len(other[0].items) > 1 and \
            all(isinstance(v, sp.Expr) or isinstance(v, Eqn) and v.named for v in items):
        # 3, 4 in order
        return [Seq(other[0].kind, tuple(v.rhs if isinstance(v, Eqn) else v for v in items))]
    return items


# a multiple-choice answer: the letter alone ("C", "(C)", "C)") or with its label text ("(C) 12",
# "C. x = 42")
_CHOICE = re.compile(r"\(?([A-E])\)?|(?:\(([A-E])\)|([A-E])[.:)](?=\s))\s*([^\s=+\-*/^<>!_,;].*)")


# "C Cecile"; not "A triangle"
_CHOICE_GOLD = re.compile(r"()()([A-E])\s+([A-Z][a-z]+\b.*)", re.DOTALL)


# in label text: a hedge or a second choice
_OTHER_CHOICE = re.compile(r"(?<![\w\\])[A-E](?!\w)|\b(?:or|and)\b")


def _choice(s, gold=False):
    """(letter, label text or "") of a multiple-choice answer, else None; a gold may also be
    "C Cecile" (a letter, a space and a capitalized name)."""
    m = _CHOICE.fullmatch(s) or gold and _CHOICE_GOLD.fullmatch(s)
    return (m.group(1) or m.group(2) or m.group(3), (m.group(4) or "").strip()) if m else None


def _same_choice(pred, gold, deadline):
    """A choice gold accepts its letter, alone or with its own label text (any label text for a
    bare-letter gold), or that label text alone; never more math after the letter ("E+1", "B = 7")
    or a second choice ("B, C", "B or C")."""
    letter, text = gold
    choice = _choice(pred)
    if choice is None:  # the gold's label text alone: "x = 42" for "C. x = 42"
        return bool(text) and not _OTHER_CHOICE.search(text) and equivalent(pred, [text], deadline)
    if choice[0] != letter or _OTHER_CHOICE.search(choice[1]):
        return False
    return not (choice[1] and text) or equivalent(choice[1], [text], deadline)


def equivalent(pred, golds, deadline):
    if len(pred) > 10 * MAX_ANSWER_CHARS:
        return False  # not a final answer
    try:
        (p, p_pct), cleaned = clean_answer(pred, deadline), \
            [clean_answer(g, deadline) for g in golds]
        g = ", ".join(c for c, _ in cleaned)
        if not p:
            return False
        # 2,74 for a one-number gold: a decimal comma
        if not re.search(r",|;|\b(?:and|or)\b", g) and re.fullmatch(r"-?\d+,\d+", p):
            p = p.replace(",", ".")
        if squash(p) == squash(g):
            return True
        choice = _choice(g, gold=True)
        if choice:
            return _same_choice(p, choice, deadline)
        p_items, g_items = parse_answer(p, deadline), parse_answer(g, deadline)
        p_items, g_items = _shape(p_items, g_items, deadline), _shape(g_items, p_items, deadline)
        # the same answer twice ("x+11 or 11+x") is not a hedge, nor two golds
        if len(p_items) != len(g_items):
            p_items, g_items = ([v for k, v in enumerate(items)
                                 if not any(_same(v, u, deadline) for u in items[:k])]
                                for items in (p_items, g_items))
        if _match(p_items, g_items, deadline):
            return True
        if len(p_items) != 1 or len(g_items) != 1 or not isinstance(p_items[0], sp.Expr):
            return False
        value = p_items[0]
        scaled = value / 100 if p_pct else value * 100  # 25% = 0.25
        if p_pct != any(pct for _, pct in cleaned) and _same(scaled, g_items[0], deadline):
            return True
        approx = decimal_gold(g)
        if approx and value.is_number and not DECIMAL.fullmatch(re.sub(r"\s+", "", p)):
            tick(deadline)
            # not sp.Abs(...): its sign test on a long sum took 0.5 s
            diff = sp.N(value - approx[0], 30)
            return bool(diff.is_real and abs(diff) < approx[1])
        return False
    except Exception:  # Refused or any sympy error on an odd answer: not equivalent, never a crash
        return False


# --------------------------------------------------------------------------------- one box per part
_RETRACT = re.compile(r"\b(?:wait|actually|instead|mistake|wrong|incorrect|error|re-?check|"
                      r"correction|oops)\b", re.I)


def answer_parts(text, boxes, golds, deadline):  # D13
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
