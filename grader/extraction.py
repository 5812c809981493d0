"""Where the final answer sits in a response (docs/grader.md): the last \\boxed{...} (hedges and
retractions read), "the answer is ..." phrases, a response or last line that is only a value, a
final sentence stating one value. Texts in, answer texts out; `extract_final` picks among them
(after </think> only, before an invented next turn) for reward.py."""
import re

from grader.limits import MAX_ANSWER_CHARS, TAIL_CHARS, tick
from grader.parser import WORDS

# --------------------------------------------------------------------------------------- extraction
# also a bare boxed{5}
_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])\s*(\{)?|(?<![a-zA-Z\\])boxed(\{)")


_LAYOUT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}|\\[,;:! ()\[\]]|\\q?quad|"
                     r"[\s$*().]")


# what may stand between two boxes of one answer, once _LAYOUT is removed: "3, 5", "3 or 4",
# "x = 3 or x = 4"
_JOINED = re.compile(r"(?:,|;|&|/|and|or)?(?:maybe|possibly|perhaps)?(?:[a-zA-Z](?:_\w)?=)?")


# right after an answer, a second value: "\boxed{3} (or maybe 4)",
# "The answer is 3. Or it could be 4." (a hedge); not "Alternatively, we could solve ..." (another
# method)
HEDGE = re.compile(r"[\s$.,;:)\]}*]*\(?\s*(?:or|maybe|possibly|perhaps|alternatively),?\s+"
                   r"(?:maybe\s+|possibly\s+|perhaps\s+|it (?:could|might) be\s+)?"
                   r"[$\\(]*\s*-?\.?\d", re.I)


PHRASE = re.compile(r"(?:(?:final\s+)?answer(?:\s*\*\*)?\s*"
                    r"(?:is\b|:|=|(?:should|would|must|will) be\b)|final\s+answer\b|"
                    r"(?P<bare>(?:^|(?<=\n))[ \t*#]*answer\**[ \t]+(?=[-$\\(\d]))|"  # "Answer 5"
                    r"####|答案\s*(?:是|为|:|：)|r[ée]ponse\s*(?:est\b|:))[\s*:]*", re.I)


# Minerva's "The largest $n$ is 34."
_SENTENCE = re.compile(r"the\s.{0,80}?\s(?:is|are)\s+(.+)", re.I | re.DOTALL)


_CUT = re.compile(r"\.(?=\s|$)|。|\n|,?\s+(?:since|because|as|which|where|so)\b|"
                  r",\s*(?:since|because|which|so)\b|"
                  r"\s\((?:i\.e\.|e\.g\.|that is|approx|about|rounded)")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s?\\?%)?")  # 35, 1,234, 2.5, 100%


_HOPE = re.compile(r"\s*I hope it is correct\.?$", re.I)  # Minerva's closing sentence


# "... is 2/3.", "... is $(7, 6)$" (a closed $...$ needs no period), Geometry3K's
# "The angle is [90]."
_STATED = re.compile(r"\s(?:is|are|equals|=)\s+(?:\$([^$]{1,200})\$[.!]?|(-?\d+(?:\.\d+)?/\d+)[.!]|"
                     r"\[\s*([^\[\]a-zA-Z]{1,50}?)\s*\][.!])$")


# a value in math delimiters: $...$, \(...\), \[...\] (a sentence's one span is its answer:
# "We find that $x < 3$.")
SPAN = re.compile(r"\$\$([^$]{1,300})\$\$|\$([^$]{1,300})\$|"
                  r"\\\((.{1,300}?)\\\)|\\\[(.{1,300}?)\\\]", re.DOTALL)


# a value in bold: "... هو **92**.", "一共有**858颗**糖果。"
_BOLD = re.compile(r"\*\*([^*]{1,60})\*\*")


# markdown bold around a value, as layout: "64 + 67 = **131**", "**131**" (not a**2: a power)
_EMPHASIS = re.compile(r"(?<![\w*\\])\*\*(?=\S)([^*\n]{1,60}?)(?<=\S)\*\*(?![\w*])")


# x >= 5 is no number's answer
_RELATION = re.compile(r"[<>≤≥≠]|!=|\\(?:le|ge|ne|lt|gt|leq|geq|neq)(?![a-zA-Z])")


# English, Chinese and Hindi sentence ends; a capital word after a math span
# ("... = 6$ So, the pair is ...")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？।])|(?<=\$)\s+(?=[A-Z][a-z])")


_PLAN = re.compile(r"(?:let|first|next|then|to|we (?:need|want|must)|find|compute|calculate|"
                   r"determine|suppose|given|if|consider|or|maybe|perhaps|possibly|alternatively)\b",
                   re.I)


def _brace(m):
    """Index of the opening brace of a _BOX match, or None (\\boxed 5)."""
    return m.start(1) if m.group(1) else m.start(2) if m.group(2) else None


def find_boxes(text, deadline):
    """(start, end, content) of every top-level \\boxed{...} / \\fbox{...} / \\boxed x in order;
    content None: never closed. A box inside another box is part of its content, so contents never
    overlap and slicing them is linear;
    a box that holds only a box (\\boxed{\\boxed{5}}) is its inner box."""
    closer, stack = {}, []
    for m in re.finditer(r"[{}]", text):  # one linear pass of brace matching
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closer[stack.pop()] = m.start()
    out, inside = [], -1  # inside: the end of the last closed box
    for m in _BOX.finditer(text):
        tick(deadline)
        if m.start() < inside:
            continue
        brace = _brace(m)
        if brace is None:
            word = re.match(r"[^\s$\\,]+", text[m.end() : m.end() + 100])
            out.append((m.start(), m.end() + len(word.group()), word.group().rstrip("."))
                       if word else (0, 0, None))
        elif closer.get(brace) is None:
            out.append((m.start(), None, None))
        else:
            lo, inside = brace + 1, closer[brace]
            hi = inside
            while (inner := _BOX.match(text, lo)) and _brace(inner) is not None and \
                    closer.get(_brace(inner)) == hi - 1:
                lo, hi = _brace(inner) + 1, hi - 1
            out.append((m.start(), inside + 1, text[lo:hi]))
    return out


def from_boxes(text, boxes, deadline):
    """The last box, joined with the boxes just before it that only a comma, "and" or "or" separates
    from it ("\\boxed{3} and \\boxed{5}" -> "3, 5"; "\\boxed{3} or \\boxed{4}" -> "3 or 4", a
    hedge)."""
    start, end, answer = boxes[-1]
    if answer is None:
        return None  # the response was cut inside its last box
    if HEDGE.match(text[end : end + 100]):
        return ""  # \boxed{3} (or maybe 4): a hedge, no answer
    run, seen, size, sep = [answer], {answer}, len(answer), ", "
    for begin, end, content in reversed(boxes[:-1]):
        tick(deadline)
        between = text[end:start]
        if content is None or len(between) > 40 or \
                not _JOINED.fullmatch(_LAYOUT.sub(r"\1", between).lower()):
            break
        sep = " or " if "or" in between else sep
        if content not in seen:
            run, size = [content] + run, size + len(content)
            seen.add(content)
        start = begin
        if size > 10 * MAX_ANSWER_CHARS:
            break  # already too long to be a final answer (see equivalent)
    return sep.join(run)


def from_phrase(text):
    """Without a box: the text after the last "the answer is" / "Answer:" / "####", to the end of
    its sentence; a bare "Answer 5" (no colon) only on the last line, not as a heading
    ("Answer 2. The value is 7.\n...")."""
    phrases = list(PHRASE.finditer(text))
    rest = text[phrases[-1].end() :].strip() if phrases else ""
    display = re.fullmatch(r"\\\[.*\\\]|\$\$.*\$\$", rest, re.DOTALL)
    if not phrases or phrases[-1].group("bare") and "\n" in rest and not display:
        return None  # "Answer 2. ...\n..." is a heading; "Answer \[ \n 9 \n \]" a display
    rest = text[phrases[-1].end() :].lstrip(" *")
    rest = rest.lstrip("\n") if rest.startswith(("\n\\[", "\n$$")) else rest
    for a in ("\\[", "\\]", "\\(", "\\)", "$"):
        rest = rest.replace(a, "")
    answer, *after = _CUT.split(rest.strip(), 1)
    if after and HEDGE.match(after[0]):
        return ""  # "3. Or maybe 4." is a hedge: no answer
    sentence = _SENTENCE.fullmatch(answer)
    answer = (sentence.group(1) if sentence else answer).strip(" *")
    # "Jane started growing Sphere 3 hours ago"
    if len(re.findall(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}", answer)) >= 3:
        return from_conclusion(answer + ".") or answer  # a sentence: the one value it states
    return answer


def from_conclusion(text):
    """Without a box or phrase: a complete final sentence that states one value: its one math span
    ("We find that $x < 3$."), one bold value ("... هو **92**."), a value after "is" ("... the
    probability that Alice wins is 2/3.", "The result is $3$", "The angle is [90]."), or its one
    number ("So Tom has 35 apples left."; not one in a relation: "x >= 5"). Minerva's closing
    "I hope it is correct." is skipped. Not "the last number in the text": truncated, hedged,
    multi-value or planning ("Let ...") endings give None."""
    last = _HOPE.sub("", text.strip()).rsplit("\n", 1)[-1].strip()
    sentence = [s for s in _SENTENCE_END.split(last) if s.strip()][-1:] or [""]
    sentence = sentence[0].strip()
    if _PLAN.match(sentence) or \
            re.search(r"\b(?:or|maybe|possibly|perhaps|not|never|cannot)\b|n't\b", sentence, re.I):
        return None  # a plan, a hedge or a negation ("It is not 5.")
    stated = _STATED.search(sentence[-300:])
    if stated:
        return next(g for g in stated.groups() if g is not None).strip()
    complete = sentence.endswith((".", "!", "。", "！", "।")) and len(sentence) <= 300
    spans = [next(g for g in m.groups() if g is not None) for m in SPAN.finditer(sentence)]
    bold = [m.group(1) for m in _BOLD.finditer(sentence) if _NUMBER.search(m.group(1))]
    if len(spans) + len(bold) > 1 or \
            not (complete or spans and sentence.endswith(("$", "\\)", "\\]"))):
        return None
    if spans or bold:
        return (spans or bold)[0].strip()
    numbers = _NUMBER.findall(sentence)
    if len(sentence.split()) > 20 or _RELATION.search(sentence) or len(numbers) != 1:
        return None
    return numbers[0].rstrip(",")


# --------------------------------------------------------------------------------- the final answer
# the model's turn ends at a chat-template token: what follows (an invented next turn) is no answer
_TURN_END = re.compile(r"<\|[a-z_]{2,30}\|>|<(?:start|end)_of_turn>|</s>")
_FOREIGN = r"[^\x00-\x7f°²³¹⁰⁴-⁹⁻π√≤≥≠±−×÷∞€£¥]"  # letters of other scripts: prose, not a value
_NOT_UNIT = {"or", "and", "not", "no", "is", "wrong", "maybe", "perhaps", "possibly",
             "approximately", "about"}


def _bare(line):
    """`line` as an answer when it is only a value: "42", "x = 3", "1,234", "33.5%", "3+2",
    "$\\frac13 $", "\\[ 9 \\]", "$28$ %", "$1,000.99" (money), "[45 degrees]" (Geometry3K's
    brackets), "C", in markdown bold or not ("64 + 67 = **131**"); else None. Words other than
    function names and one unit after a number ("45 degrees") make it prose, and so do letters of
    other scripts."""
    s = line.strip()
    s = s[:-1].rstrip() if s.endswith(".") and not s.endswith("..") else s
    s = _EMPHASIS.sub(r"\1", s)
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
