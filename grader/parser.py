"""The math answer parser (docs/grader.md): a small hand-written tokenizer and recursive-descent
parser that builds sympy objects directly: numbers, expressions, tuples, intervals, sets, matrices,
equations and relations. Model output never reaches eval, exec, sympify or parse_expr; every size is
capped (grader/limits.py)."""
import math
import re
from collections import namedtuple

import sympy as sp

from grader.limits import (
    MAX_ANSWER_CHARS,
    MAX_BITS,
    MAX_DEPTH,
    MAX_DIGITS,
    MAX_FACTORIAL,
    MAX_LOG_MAGNITUDE,
    MAX_SYMBOLIC_EXPONENT,
    MAX_TOKENS,
    MAX_TRIG_ARGUMENT,
    Refused,
    tick,
)

# ------------------------------------------------------------------------------------------- parser
# kind: "()" "[]" "(]" "[)" tuples/intervals, "{}" set, "mat" matrix rows
Seq = namedtuple("Seq", "kind items")


# named: the left side is a name (x, AB, y_1, f(x)), so x=5 also means 5
Eqn = namedtuple("Eqn", "lhs rhs named")


# expr > 0 (strict) or expr >= 0, for relations that are not an interval
Rel = namedtuple("Rel", "expr strict")


_TOKEN = re.compile(r"\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\\[a-zA-Z]+|\\[{}|]|"
                    r"[a-zA-Z]+|<=|>=|!=|[-+*/^_()\[\]{}=<>!|,;:&])")


_FUNCS = {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec, "csc": sp.csc,
          "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan, "sinh": sp.sinh, "cosh": sp.cosh,
          "tanh": sp.tanh, "exp": sp.exp, "ln": sp.log, "log": sp.log}


_CONSTS = {"pi": sp.pi, "infty": sp.oo, "infinity": sp.oo, "inf": sp.oo, "emptyset": sp.EmptySet,
           "reals": sp.Reals}


# words read as one token; other words are letters (xy = x*y) or text
WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "ln", "log", "exp",
         "sqrt", "pi", "inf", "infinity", "and", "or"}


_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda "
             "mu nu xi rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi "
             "Sigma Phi Psi Omega".split())


_RELOPS = {"=": "=", "\\approx": "~", "<": "<", "\\lt": "<", ">": ">", "\\gt": ">", "<=": "<=",
           "\\le": "<=", "\\leq": "<=", "\\leqslant": "<=", ">=": ">=", "\\ge": ">=", "\\geq": ">=",
           "\\geqslant": ">=", "\\in": "in", "\\ne": "!=", "\\neq": "!=", "!=": "!="}


_SEPARATORS = {",", ";", "and", "or"}


_LETTERS = r"(?:[a-zA-Z]|\\[a-zA-Z]+)+(?:_(?:\{[^{}]*\}|\w))?"  # x, AB, y_1, \theta, S_{MBCN}


# a name as the left side of an answer (x, f(x), a length |AB|, \frac{NO}{BO}): x = 5 also means 5
_NAME = re.compile(rf"{_LETTERS}(?:\([^()+\-*/^]*\))?|\|[A-Z]{{2,}}\||"
                   rf"\\frac\{{{_LETTERS}\}}\{{{_LETTERS}\}}")


def _tokenize(s):
    tokens, i, s = [], 0, s.rstrip()
    while i < len(s):
        m = _TOKEN.match(s, i)
        if not m:
            raise Refused(f"unexpected character {s[i]!r}")
        tok, i = m.group(1), m.end()
        if tok[0].isalpha() and tok not in WORDS:
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
        if b.is_Rational and e.is_Integer:  # exact: refuse results over MAX_BITS before computing
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
    items := relation (sep relation)* ; relation := setexpr (relop setexpr)* ;
    setexpr := sum (\\cup sum)* ; sum := [+-] term ([+-] term)* ;
    term := power ((* / \\cdot \\times \\div | implicit) power)* ; power := postfix [^ arg] ;
    postfix := primary [!]* ; primary := number | letter | command | group."""

    def __init__(self, text, deadline):
        self.toks, self.i, self.depth, self.deadline = _tokenize(text), 0, 0, deadline

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected=None):
        tick(self.deadline)
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
        if ops[:1] == ["~"] and named[0] and isinstance(sides[0], sp.Expr) and \
                sides[0].free_symbols:
            # x \approx 11: the value stated, as x = 11 (\pi \approx 3.14 stays \pi)
            sides, ops = sides[:2], ["="]
        # x = 5\sqrt{2} \approx 7.07: what comes after the first \approx is only an approximation
        elif "~" in ops:
            sides, ops = sides[: ops.index("~") + 1], ops[: ops.index("~")]
        if not ops:
            return sides[0]
        if ops == ["in"]:
            return as_set(sides[1])
        if set(ops) == {"="}:
            lhs, rhs = sides[0], sides[-1]
            if len(sides) == 2 and named[1] and not named[0] and isinstance(lhs, sp.Expr) and \
                    not lhs.free_symbols:
                lhs, rhs, named = rhs, lhs, named[::-1]  # 2 = x: the value on the left
            if len(sides) > 2 or not (isinstance(rhs, sp.Expr) and isinstance(lhs, sp.Expr)) or \
                    not (lhs.free_symbols or rhs.free_symbols):
                # x = 2 + 3 = 5, 6/8 = 3/4, (a, b) = (1, 2), S_1:S = 7:32, A:B = 1: the last side
                return rhs
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
            op, left, right = self.take(), as_set(value), as_set(self.sum())
            value = {"\\cup": sp.Union, "\\cap": sp.Intersection,
                     "\\setminus": sp.Complement}[op](left, right)
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
            if self.peek() in ("*", "\\cdot", "\\times") and self.take() or \
                    self._starts_factor(self.peek()):
                value = _check(value * self.power())
            elif self.peek() in ("/", "\\div") and self.take():
                value = _check(value / self.power())
            elif self.skip("\\bmod"):  # 17 \bmod 5
                value = _check(sp.Mod(value, self.power()))
            else:
                return value

    def _starts_factor(self, tok):
        """Implicit multiplication (2x, 3(x+1), 2\\pi, x\\sqrt{2}); a number only after a non-number
        (12 34: none)."""
        if tok is None or tok in _SEPARATORS:
            return False
        if tok[0].isdigit():
            return not self.toks[self.i - 1][0].isdigit()
        name = tok[1:] if tok[0] == "\\" else None
        return tok[0].isalpha() or \
            tok in ("(", "\\lfloor", "\\lceil", "\\frac", "\\sqrt", "\\binom") or \
            (name in _FUNCS or name in _CONSTS or name in _GREEK)

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
            if not (n.free_symbols or k.free_symbols or n.is_Integer and k.is_Integer
                    and 0 <= n <= MAX_FACTORIAL):
                raise Refused("binomial")
            return _check(sp.binomial(n, k))
        # \angle APC: a name
        if (len(tok) == 1 and tok.isalpha()) or name in _GREEK or name == "angle":
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
        """\\sin x, \\sin^2 x, \\log_2 8, \\ln(x+1), \\sin 2x \\cos x: the argument is a product of
        plain factors."""
        base = self.arg() if name == "log" and self.skip("_") else None
        exponent = self.arg(signed=True) if self.skip("^") else None
        grouped = self.peek() in ("(", "{")
        # \sin(x)^2 = (\sin x)^2, \sin x^2 = \sin(x^2)
        arg = self.postfix() if grouped else self.power()
        while not grouped and self._starts_factor(self.peek()) and \
                self.peek().lstrip("\\") not in _FUNCS:
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


def as_set(v):
    """Sets for \\cup, \\in and comparisons: {..} -> FiniteSet, a 2-element bracket
    pair -> Interval."""
    if isinstance(v, sp.Set):
        return v
    if isinstance(v, Seq) and v.kind == "{}" and all(isinstance(x, sp.Expr) for x in v.items):
        return sp.FiniteSet(*v.items)
    if isinstance(v, Seq) and v.kind in ("()", "[]", "(]", "[)") and len(v.items) == 2:
        lo, hi = v.items
        if isinstance(lo, sp.Expr) and isinstance(hi, sp.Expr) and \
                not (lo.free_symbols or hi.free_symbols):
            return sp.Interval(lo, hi, v.kind[0] == "(", v.kind[1] == ")")
    raise Refused("not a set")


def _interval(sides, ops, named):
    """0 < x <= 5, x >= 3, 5 > x, x != 1, -x > -1, |x - 3| < 2, 0 < f(x) < 1: the set of the one
    variable (its name is dropped, like x = 5 -> 5). The varying side is a symbol, a name of several
    letters (f(x), |AB|: the set of its values) or an expression of one symbol for _preimage (the
    set of that symbol)."""
    varying = [k for k, side in enumerate(sides)
               if not isinstance(side, sp.Expr) or side.free_symbols]
    if len(varying) != 1 or not isinstance(sides[varying[0]], sp.Expr) or {"=", "in"} & set(ops):
        raise Refused("relation")
    k = varying[0]
    var = sides[k]
    if ops == ["!="] and isinstance(var, sp.Symbol):
        return sp.Complement(sp.Reals, sp.FiniteSet(sides[1 - k]))
    # 1 < 2 < x: a side without the variable
    if "!=" in ops or any(j not in (k - 1, k) for j in range(len(ops))):
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
    """The set of the one symbol x of `expr` where `expr` takes `values` (an interval or a union of
    intervals), for `expr` affine in x or in one |u| with u of the same kind: -x > -1 -> x < 1,
    1 <= |z| <= 3/2 -> [-3/2,-1] U [1,3/2]. Anything else is refused."""
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
            pieces.append(sp.Interval(*ends) if a.is_positive
                          else sp.Interval(ends[1], ends[0], ends[3], ends[2]))
        values = sp.Union(*pieces)
        if inner == x:
            return values
        # |u| in values  <->  u in values or -values
        values = sp.Intersection(values, sp.Interval(0, sp.oo))
        values = sp.Union(values, sp.Union(*[
            sp.Interval(-v.end, -v.start, v.right_open, v.left_open)
            for v in (values.args if isinstance(values, sp.Union) else [values])
            if isinstance(v, sp.Interval)]))
        expr = inner.args[0]
    raise Refused("relation")


def parse_answer(text, deadline):
    """All answers in `text` as a list of values; one \\pm makes two answers."""
    if len(text) > MAX_ANSWER_CHARS:
        raise Refused("answer too long")
    variants = [text]
    if text.count("\\pm") + text.count("\\mp") == 1:
        variants = [re.sub(r"\\[pm]{2}", "+", text), re.sub(r"\\[pm]{2}", "-", text)]
    try:
        return [item for v in variants for item in _Parser(v, deadline).parse()]
    except Refused:
        # \lim_{x \to 0} \frac{\sin x}{x} = 1: a left side it cannot read, a value
        last = text.rsplit("=", 1)[-1]
        # not "f(x) = 3 \text{ when } x = 5"
        words = re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}", text)
        readable = "=" in text and not re.search(r"[,;]|\\pm", text) and \
            all(w in WORDS for w in words)
        items = _Parser(last, deadline).parse() if readable else []
        if len(items) == 1 and isinstance(items[0], sp.Expr) and not items[0].free_symbols:
            return items
        raise
