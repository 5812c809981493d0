"""Chained sums: a second built-in-sized task with longer responses than one-digit sums, for
SmolLM2-135M (the RQ2 experiments of docs/experiments.md, where spurious tokens need room to occur).

  python -m tasks.chain_sums  # (re)writes tasks/chain_sums.jsonl (726 problems)
  python train.py --data tasks/chain_sums.jsonl --prompt-key prompt --answer-key answer --no-chat \\
      --instruction "" --max-response-len 64 --reward tasks.chain_sums:reward --heldout 64 \\
      --max-tokens-per-micro-batch 2048
      # the cpu preset's one micro-batch per mini-batch: ~25 GB here

A problem is the sum of three one-digit numbers, shown after three worked examples in raw text, so
the model writes the running sums before the answer ("3 + 5 = 8, 8 + 2 = 10. The answer is 10.").
SmolLM2-135M-Instruct is right 23% of the time at temperature 1.0 (64 problems x 4 samples;
docs/experiments.md has the table that chose it), and 87% of its responses run to the 64-token
budget (61 tokens on average): the answer, then more "Q: ... A: ..." text, since raw text has no
end of turn.

`reward(response, answer)`: +1 / -1 (the DAPO reward) on the text before the first blank line,
i.e. the answer to this problem and not the examples the model goes on to invent, graded by
`reward.grade`.
"""
import json
import random
import sys
from pathlib import Path

import reward as grader

SHOTS = ((7, 7, 4), (3, 4, 4), (3, 2, 5))  # the worked examples every prompt starts with


def worked(terms: tuple[int, ...]) -> str:
    """'3 + 5 = 8, 8 + 2 = 10. The answer is 10.': the running sums, then the answer."""
    steps, total = [], terms[0]
    for x in terms[1:]:
        steps.append(f"{total} + {x} = {total + x}")
        total += x
    return f"{', '.join(steps)}. The answer is {total}."


def question(terms: tuple[int, ...]) -> str:
    return f"Q: {' + '.join(map(str, terms))} = ?\nA:"


def problem(terms: tuple[int, ...]) -> dict:
    """One row: the worked examples, then the question."""
    shots = "".join(f"{question(s)} {worked(s)}\n\n" for s in SHOTS)
    return {"prompt": shots + question(terms), "answer": str(sum(terms))}


def reward(response: str, answer: str) -> float:
    """+1 if the text before the first blank line answers `answer` (reward.grade), else -1."""
    return 1.0 if grader.grade(response.split("\n\n")[0], answer) else -1.0


def graded_chars(response: str) -> int:
    """The characters `reward` reads: the text before the first blank line (reward.graded_chars)."""
    return len(response.split("\n\n")[0])


def main(out: Path = Path(__file__).with_suffix(".jsonl")) -> None:
    """Every sum of three digits 1-9 but the examples', shuffled (seed 0), one JSONL row each, into
    `out`."""
    triples = [(a, b, c) for a in range(1, 10) for b in range(1, 10) for c in range(1, 10)
               if (a, b, c) not in SHOTS]
    random.Random(0).shuffle(triples)
    out.write_text("".join(json.dumps(problem(t)) + "\n" for t in triples))
    print(f"{out}: {len(triples)} problems")


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:2]))
