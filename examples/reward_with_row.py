"""Your own rewards that read the data row, for train.py and eval.py (reward.py, "your own reward").

`within_tolerance` takes the row's fields by keyword: a row
{"question": ..., "answer": "9.81", "tolerance": 0.05} pays a final answer within `tolerance` of the
gold (the default 0: exactly). `concise` is batched: one call per step with lists, so it can compare
the responses of a batch with each other.

  python train.py --data my.jsonl --prompt-key question --answer-key answer \\
      --reward examples/reward_with_row.py:within_tolerance --out-dir runs/tolerance
  python train.py --data my.jsonl --prompt-key question --reward examples/reward_with_row.py:concise

The contract: FUNCTION(response, answer, prompt=None, **row) -> a finite number, positive exactly
when the response is correct; after (response, answer) it takes any of the row's fields by keyword
(`prompt` is the problem text, without the instruction; a parameter without a default is a field
every row must have). Batched (`FUNCTION.batched = True`): the same arguments as lists, one entry
per response, and a list of numbers back.
"""
from reward import extract_answer, grade


def within_tolerance(response: str, answer: str, tolerance: float = 0.0, **row) -> float:
    """+1 when the final answer (reward.extract_answer: the last \\boxed{}, or "the answer is ...")
    is a number within the row's `tolerance` of the gold, else -1."""
    try:
        return 1.0 if abs(float(extract_answer(response) or "nan") - float(answer)) <= tolerance \
            else -1.0
    except ValueError:  # not a number
        return -1.0


def concise(responses: list[str], answers: list, prompt: list[str]) -> list[float]:
    """+1 for a correct response (reward.grade), +1.5 when it is also shorter than the median
    correct response of the batch, 0.5 when it repeats the problem's text; -1 when wrong."""
    right = [grade(r, a) for r, a in zip(responses, answers)]
    lengths = sorted(len(r) for r, ok in zip(responses, right) if ok)
    median = lengths[len(lengths) // 2] if lengths else 0
    return [-1.0 if not ok else 0.5 if p.strip() in r else 1.5 if len(r) < median else 1.0
            for r, ok, p in zip(responses, right, prompt)]


concise.batched = True
