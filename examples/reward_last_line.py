"""An example of your own reward for train.py and eval.py
(`--reward examples/reward_last_line.py:last_line`).

The task need not be math: here a response is right when its last non-empty line is the answer,
compared as text (case and surrounding spaces, quotes and a final period ignored), as for
short-answer questions, names, labels or formats that no math grader reads.

    python train.py --data my.jsonl --prompt-key question --answer-key label \\
        --reward examples/reward_last_line.py:last_line --out-dir runs/mine
    python eval.py --run runs/mine  # eval.py takes the run's reward from its config.json

The contract (reward.py, "your own reward"): FUNCTION(response, answer) -> a finite number, positive
exactly when the response is correct; `answer` is the row's --answer-key field, a string or a list
of accepted strings.
"""


def last_line(response: str, answer: str | list[str]) -> float:
    """+1 when the last non-empty line of `response` equals the answer (or one of the answers),
    else -1."""
    lines = [line for line in response.splitlines() if line.strip()]
    said = _normal(lines[-1]) if lines else ""
    accepted = [answer] if isinstance(answer, str) else answer
    return 1.0 if said and said in {_normal(a) for a in accepted} else -1.0


def _normal(text: str) -> str:
    return text.strip().rstrip(".").strip().strip("\"'`").strip().lower()
