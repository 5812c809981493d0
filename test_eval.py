"""Tests of eval.py: benchmark loading (local files and the Hub layout), avg@k / pass@k arithmetic, the CLI,
and an end-to-end run with the tiny random model that writes results.json and table.md."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import eval as ev
import reward

DATA = Path(__file__).parent.parent / "shared" / "data" / "benchmarks"
ROWS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272, "olympiadbench": 675, "gsm8k": 1319}


def test_eval_every_local_benchmark_loads_with_gold():
    for name, n in ROWS.items():
        rows = ev.load_benchmark(name, DATA)
        assert len(rows) == n, name
        for row in rows:
            assert isinstance(row["problem"], str) and row["problem"].strip(), name
            assert isinstance(row["answer"], str) and row["answer"].strip(), name
            gold = row["gold"] if isinstance(row["gold"], list) else [row["gold"]]
            assert gold and all(isinstance(g, str) and g.strip() for g in gold), name
            assert reward.grade(f"So \\boxed{{{row['answer']}}}.", row["gold"]), (name, row["gold"])  # grader reads it


def test_eval_known_golds():
    def gold(name, i):
        return ev.load_benchmark(name, DATA)[i]["gold"]

    assert gold("aime24", 0) == "204"  # Aya's walk, 2024 AIME I #1
    assert gold("aime25", 0) == "70"  # sum of bases b > 9 with 17_b | 97_b
    assert gold("amc23", 0) == "27.0"  # a float in the file, kept as a string
    assert gold("math500", 0) == r"\left( 3, \frac{\pi}{2} \right)"
    assert gold("minerva", 0) == "1.6"  # last \boxed{} of the solution
    assert gold("minerva", 1) == "4.5e33"
    assert gold("olympiadbench", 0) == ["2"]
    assert gold("olympiadbench", 13) == ["$69$,$84$"]  # a multiple-answer row
    assert ev.load_benchmark("olympiadbench", DATA)[13]["answer"] == "$69$,$84$"
    assert reward.grade(r"\boxed{84, 69}", gold("olympiadbench", 13))  # a list gold needs every answer
    assert not reward.grade(r"\boxed{69}", gold("olympiadbench", 13))
    assert gold("gsm8k", 0) == "18"  # "#### 18"
    assert gold("gsm8k", 146) == "2125"  # "#### 2,125": thousands comma dropped


def test_eval_missing_gold_is_an_error(tmp_path):
    lines = [{"question": "1+1?", "answer": "2 #### 2"}, {"question": "2+2?", "answer": "it is four"}]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    with pytest.raises(ValueError, match=r"gsm8k: row 1 .*no gold answer"):
        ev.load_benchmark("gsm8k", tmp_path)
    (tmp_path / "minerva_math.jsonl").write_text(json.dumps({"problem": "x?", "solution": "no box here"}))
    with pytest.raises(ValueError, match=r"minerva: row 0 "):
        ev.load_benchmark("minerva", tmp_path)


def test_eval_hub_layout_mapping(tmp_path, monkeypatch):
    """The Hub code path (datasets.load_dataset) on local parquet folders in the layout of each Hub dataset."""
    import datasets

    hub_rows = {
        "amc23": [{"id": 0, "question": "Q?", "answer": 27.0, "url": "u"}],
        "aime24": [{"id": 60, "problem": "P?", "solution": "so $\\boxed{204}$", "url": "u"},
                   {"id": 61, "problem": "P2?", "solution": "113", "url": "u"}],
        "minerva": [{"question": "M?", "answer": "1.6"}],
        "olympiadbench": [{"question": "O?", "final_answer": ["$69$,$84$"], "is_multiple_answer": True}],
        "math500": [{"problem": "C?", "solution": "\\boxed{9}", "answer": "9", "subject": "s", "level": 1,
                     "unique_id": "x"}],
    }
    for name, rows in hub_rows.items():
        folder = tmp_path / name
        folder.mkdir()
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "test-00000-of-00001.parquet"))
        monkeypatch.setitem(ev.BENCHMARKS, name, replace(ev.BENCHMARKS[name], hub_id=str(folder)))
    assert ev.load_benchmark("amc23") == [{"problem": "Q?", "answer": "27.0", "gold": "27.0"}]
    assert [r["gold"] for r in ev.load_benchmark("aime24")] == ["204", "113"]
    assert ev.load_benchmark("minerva")[0]["gold"] == "1.6"
    assert ev.load_benchmark("olympiadbench")[0] == {"problem": "O?", "answer": "$69$,$84$", "gold": ["$69$,$84$"]}
    assert ev.load_benchmark("math500")[0]["gold"] == "9"


def test_eval_pass_at_k_hand_computed():
    # 1 - C(n-c, k) / C(n, k)
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6 -> 0.5
    assert ev.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10 -> 0.9
    assert ev.pass_at_k(32, 1, 1) == pytest.approx(1 / 32)  # pass@1 = c/n
    assert ev.pass_at_k(4, 0, 4) == 0.0 and ev.pass_at_k(4, 1, 4) == 1.0 and ev.pass_at_k(4, 3, 2) == 1.0


def test_eval_metrics_on_fabricated_verdicts():
    def problem(verdicts, lengths, truncated):
        return {"samples": [{"correct": v, "length": n, "truncated": t} for v, n, t in zip(verdicts, lengths, truncated)]}

    problems = [problem([1, 0, 0, 0], [10, 20, 30, 40], [0, 0, 0, 1]),
                problem([1, 1, 1, 1], [5, 5, 5, 5], [0, 0, 0, 0]),
                problem([0, 0, 0, 0], [100, 100, 100, 100], [1, 1, 1, 1])]
    m = ev.benchmark_metrics(problems)
    assert m["k"] == 4 and m["problems"] == 3
    assert m["avg@k"] == pytest.approx(100 * (1 / 4 + 4 / 4 + 0 / 4) / 3)  # 41.67
    assert m["pass@k"] == pytest.approx(100 * (1 + 1 + 0) / 3)  # 66.67
    assert m["mean_length"] == pytest.approx((100 + 20 + 400) / 12)  # 43.33
    assert m["truncated"] == pytest.approx(100 * 5 / 12)


def test_eval_cli_flags_and_help(capsys):
    cfg = ev.cli(ev.Config, ["--models", "a", "lbl=b", "--benchmarks", "gsm8k", "--no-chat", "--k", "8",
                             "--preset", "justrl", "--max-new-tokens", "16", "--data-dir", "d"])
    assert cfg == ev.Config(models=["a", "lbl=b"], benchmarks=["gsm8k"], chat=False, k=8, preset="justrl",
                            max_new_tokens=16, data_dir="d")
    assert ev.cli(ev.Config, []) == ev.Config()
    with pytest.raises(SystemExit):
        ev.cli(ev.Config, ["--preset", "greedy"])
    with pytest.raises(SystemExit):
        ev.cli(ev.Config, ["--help"])
    assert "temperature 0.7, top-p 0.9" in capsys.readouterr().out


def _run_tiny(out, extra=()):
    return ev.main(["--models", "tiny", "--benchmarks", "gsm8k", "math500", "--data-dir", str(DATA), "--limit", "3",
                    "--k", "2", "--max-new-tokens", "6", "--batch-size", "4", "--out", str(out), *extra])


def test_eval_end_to_end_tiny_and_regrade(tmp_path):
    _run_tiny(tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["k"] == 2 and results["config"]["models"] == ["tiny"]
    benches = results["models"]["tiny"]["benchmarks"]
    assert list(benches) == ["gsm8k", "math500"]
    golds = {b: [r["gold"] for r in ev.load_benchmark(b, DATA)[:3]] for b in benches}
    for b, bench in benches.items():
        assert (bench["k"], bench["temperature"], bench["top_p"]) == (2, 1.0, 1.0)
        assert [p["index"] for p in bench["problems"]] == [0, 1, 2]
        assert [p["gold"] for p in bench["problems"]] == golds[b]
        for p in bench["problems"]:
            assert len(p["samples"]) == 2
            for s in p["samples"]:
                assert set(s) == {"text", "extracted", "correct", "length", "truncated"}
                assert 1 <= s["length"] <= 6 and (not s["truncated"] or s["length"] == 6)
        assert bench["metrics"]["problems"] == 3 and bench["metrics"]["k"] == 2
    table = (tmp_path / "table.md").read_text()
    assert "| Model | MATH500 | GSM8K | Avg |" in table  # paper order, GSM8K last
    assert table.count("| tiny |") == 3  # one summary row, two detail rows

    # re-grade: make one sample of MATH500 problem 0 right -> avg@2 = 100 * (1/2) / 3
    benches["math500"]["problems"][0]["samples"][0]["text"] = f"so \\boxed{{{golds['math500'][0]}}}"
    (tmp_path / "results.json").write_text(json.dumps(results))
    ev.main(["--regrade", str(tmp_path / "results.json")])
    regraded = json.loads((tmp_path / "results.json").read_text())["models"]["tiny"]["benchmarks"]["math500"]
    assert regraded["problems"][0]["samples"][0]["correct"] is True
    assert regraded["metrics"]["avg@k"] == pytest.approx(100 / 6)
    assert regraded["metrics"]["pass@k"] == pytest.approx(100 / 3)
    summary = next(line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in summary.split("|")[1:-1]]
    assert cells[1] == cells[3] == "16.67"  # table.md rewritten: MATH500 and Avg (= MATH500 only)


def test_eval_torchrun_two_ranks_gather_in_order(tmp_path):
    """2 processes (gloo): the problems are split round-robin and gathered to rank 0 in the original order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "eval.py",
           "--models", "tiny", "--benchmarks", "amc23", "--data-dir", str(DATA), "--limit", "3", "--k", "2",
           "--max-new-tokens", "4", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=Path(__file__).parent, env=env, check=True, capture_output=True, timeout=300)
    bench = json.loads((tmp_path / "results.json").read_text())["models"]["tiny"]["benchmarks"]["amc23"]
    assert [p["index"] for p in bench["problems"]] == [0, 1, 2]
    assert [p["gold"] for p in bench["problems"]] == ["27.0", "36.0", "45.0"]
    assert all(len(p["samples"]) == 2 for p in bench["problems"])
