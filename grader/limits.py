"""The grader's budgets (docs/grader.md): every grade is bounded without signals, so it works in
threads and worker processes. The response tail, the answer's length, tokens, nesting depth, digits,
exponents, factorials and trig arguments are capped, and one deadline is checked while extracting,
parsing and comparing (docs/paper.md, "Deliberate differences": D14). Anything refused or late
grades as not equivalent."""
import time

TAIL_CHARS = 100_000  # only the end of a response is searched for its final answer


MAX_ANSWER_CHARS = 2_000  # longer answers are compared as strings only (over 10x this, not at all)


MAX_TOKENS = 1_000


MAX_DEPTH = 60  # parser recursion (nested braces, parentheses, powers)


MAX_DIGITS = 2_000  # digits of one number literal


MAX_BITS = 1 << 16  # size of an exact number built by ^, *, ! (about 20,000 digits)


MAX_LOG_MAGNITUDE = 2e4  # |ln|value|| of a power with a non-integer exponent


# |x| of sin x, cos x, ... (symbols set to 1): larger ones take seconds to evaluate
MAX_TRIG_ARGUMENT = 1e6


MAX_FACTORIAL = 5_000


MAX_SYMBOLIC_EXPONENT = 10_000  # n in x^n when x has a symbol


class Refused(Exception):
    """The answer cannot be read, or is too large, too deep or too slow to grade."""


def tick(deadline):
    if time.monotonic() > deadline:
        raise Refused("time limit")
