"""Benchmark of reward.grade (issue 5): grades per second and the slowest single grade.

Paper: STAPO (arXiv:2602.15620) Sec. 6 grades 256 x 8 = 2,048 responses per rollout batch, so the grader must not be
the bottleneck. Corpora: the responses of shared/data/grader_cases.jsonl (real answer forms, several parse paths),
the golds of AIME, AMC, MATH-500 and OlympiadBench boxed in a response (mostly the string fast path), and hostile
inputs (refused by the size guards).

Deliberate choices:
1. One process, best of `repeats` passes per corpus (the machine is shared, so the best pass is the least noisy);
   the slowest single grade is the maximum over all passes.
2. "strict" (the paper's string match of the last box) is timed on the same corpus as the reference point.
"""
import json
import time
from pathlib import Path

import reward

_REWARD_DATA = Path(__file__).parent.parent / "shared" / "data"


def _reward_corpora():
    cases = [json.loads(line) for line in (_REWARD_DATA / "grader_cases.jsonl").read_text().splitlines() if line.strip()]
    golds = []
    for name, field in (("aime24", "answer"), ("aime25", "answer"), ("amc23", "answer"), ("math500", "answer")):
        for line in (_REWARD_DATA / "benchmarks" / f"{name}.jsonl").read_text().splitlines():
            golds.append(str(json.loads(line)[field]))
    for line in (_REWARD_DATA / "benchmarks" / "olympiadbench.jsonl").read_text().splitlines():
        golds.append(", ".join(json.loads(line)["final_answer"]))
    hostile = {"power tower": "\\boxed{9^{9^{9^{9}}}}", "100000!": "\\boxed{100000!}",
               "10,000 nested braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
               "1 MB response": "x = 1 + 1. " * 100_000 + "\\boxed{5}", "unclosed boxes": "\\boxed{" * 50_000,
               "regex bait": "a" * 100_000 + "!"}
    return {
        "grader_cases": [(c["response"], c["gold"], c["id"]) for c in cases],
        "benchmark golds": [(f"So the answer is $\\boxed{{{g}}}$.", g, g[:30]) for g in golds],
        "hostile inputs": [(text, "5", name) for name, text in hostile.items()],
    }


def _reward_run(items, fn, repeats):
    best, slowest = float("inf"), (0.0, "")
    for _ in range(repeats):
        start = time.perf_counter()
        for response, gold, name in items:
            t = time.perf_counter()
            fn(response, gold)
            slowest = max(slowest, (time.perf_counter() - t, name))
        best = min(best, time.perf_counter() - start)
    return len(items) / best, slowest


def bench_reward(repeats=3):
    reward.grade("\\boxed{\\sqrt{2}}", "\\sqrt{2}+0")  # warm sympy's caches once
    print("| corpus | responses | grade /s | strict /s | slowest grade (ms) | slowest case |")
    print("|---|---|---|---|---|---|")
    for name, items in _reward_corpora().items():
        rate, (worst, case) = _reward_run(items, reward.grade, repeats)
        strict, _ = _reward_run(items, lambda r, g: reward.reward(r, g, mode="strict"), repeats)
        print(f"| {name} | {len(items)} | {rate:,.0f} | {strict:,.0f} | {worst * 1e3:.1f} | {case} |")


if __name__ == "__main__":
    bench_reward()
