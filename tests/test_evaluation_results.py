"""evaluation/results.py: pass@k and avg@k against hand computations."""
import pytest

from evaluation.results import benchmark_metrics, pass_at_k, table


# ==================================================================================================
# evaluation/results.py: pass_at_k, benchmark_metrics
# ==================================================================================================
def test_eval_pass_at_k_hand_computed():
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6 -> 0.5
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10 -> 0.9
    assert pass_at_k(32, 1, 1) == pytest.approx(1 / 32)  # pass@1 = c/n
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 \
        and pass_at_k(4, 3, 2) == 1.0


def test_eval_metrics_on_fabricated_verdicts():
    def problem(verdicts, lengths, truncated):
        return {"samples": [{"correct": v, "length": n, "truncated": t}
                            for v, n, t in zip(verdicts, lengths, truncated)]}

    problems = [problem([1, 0, 0, 0], [10, 20, 30, 40], [0, 0, 0, 1]),
                problem([1, 1, 1, 1], [5, 5, 5, 5], [0, 0, 0, 0]),
                problem([0, 0, 0, 0], [100, 100, 100, 100], [1, 1, 1, 1])]
    m = benchmark_metrics(problems)
    assert m["k"] == 4 and m["problems"] == 3
    assert m["avg@k"] == pytest.approx(100 * (1 / 4 + 4 / 4 + 0 / 4) / 3)  # 41.67
    assert m["pass@k"] == pytest.approx(100 * (1 + 1 + 0) / 3)  # 66.67
    assert m["mean_length"] == pytest.approx((100 + 20 + 400) / 12)  # 43.33
    assert m["truncated"] == pytest.approx(100 * 5 / 12)


def test_eval_table_names_an_export_after_one_step_in_the_singular():
    """A train.py export after 1 step: "the export after 1 step" (it said "after 1 steps")."""
    metrics = benchmark_metrics([{"samples": [{"correct": 1, "length": 3, "truncated": 0}]}])
    results = {"config": {"chat": False, "instruction": "", "run": "", "temperature": 1.0,
                          "top_p": 1.0, "max_new_tokens": 8},
               "models": {"run/hf": {"benchmarks": {"heldout": {"metrics": metrics}},
                                     "export": {"step": 1, "checksum": "0a1b2c3d"}}}}
    assert "run/hf is the export after 1 step (checksum 0a1b2c3d)." in table(results)
