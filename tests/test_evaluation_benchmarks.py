"""evaluation/benchmarks.py: every benchmark loads with its gold, from the repository's local files
and from their Hub layout; a row without a gold is an error naming it."""
import json
from dataclasses import replace

import pytest

import reward
from evaluation.benchmarks import BENCHMARKS, load_benchmark
from tests.toy_task import TESTDATA, reward_jsonl

DATA = TESTDATA / "benchmarks"


# ==================================================================================================
# evaluation/benchmarks.py: BENCHMARKS, load_benchmark
# ==================================================================================================
def test_eval_every_local_benchmark_loads_with_gold():
    for name, spec in BENCHMARKS.items():
        rows = load_benchmark(name, DATA)
        assert len(rows) == len(reward_jsonl(DATA / spec.file)) >= 3, name
        for row in rows:
            assert isinstance(row["problem"], str) and row["problem"].strip(), name
            assert isinstance(row["answer"], str) and row["answer"].strip(), name
            gold = row["gold"] if isinstance(row["gold"], list) else [row["gold"]]
            assert gold and all(isinstance(g, str) and g.strip() for g in gold), name
            # the grader reads it
            assert reward.grade(f"So \\boxed{{{row['answer']}}}.", row["gold"]), (name, row["gold"])


def test_eval_known_golds():
    def gold(name, i):
        return load_benchmark(name, DATA)[i]["gold"]

    # AIME's leading zero
    assert gold("aime24", 0) == "024" and reward.grade("\\boxed{24}", gold("aime24", 0))
    assert gold("aime25", 1) == "12"
    assert gold("amc23", 0) == "55.0"  # a float in the file, kept as a string
    assert gold("math500", 0) == r"\left( 2, \frac{3\pi}{2} \right)"
    assert gold("minerva", 0) == "1.5"  # the last \boxed{} of the solution, not the first (1/4)
    assert gold("minerva", 2) == "3.15e7"
    assert gold("olympiadbench", 0) == ["$10$"]
    assert gold("olympiadbench", 1) == ["$2$,$-2$"]  # a multiple-answer row
    assert load_benchmark("olympiadbench", DATA)[1]["answer"] == "$2$,$-2$"
    assert reward.grade(r"\boxed{-2, 2}", gold("olympiadbench", 1))  # a list gold needs all answers
    assert not reward.grade(r"\boxed{2}", gold("olympiadbench", 1))
    assert gold("gsm8k", 0) == "12"  # "#### 12"
    assert gold("gsm8k", 1) == "2125"  # "#### 2,125": thousands comma dropped


def test_eval_missing_gold_is_an_error(tmp_path):
    lines = [{"question": "1+1?", "answer": "2 #### 2"},
             {"question": "2+2?", "answer": "it is four"}]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    with pytest.raises(ValueError, match=r"gsm8k: line 2 .*no gold answer"):
        load_benchmark("gsm8k", tmp_path)
    (tmp_path / "minerva_math.jsonl").write_text(json.dumps({"problem": "x?",
                                                             "solution": "no box here"}))
    with pytest.raises(ValueError, match=r"minerva: line 1 "):
        load_benchmark("minerva", tmp_path)


def test_eval_hub_layout_mapping(monkeypatch):
    """The Hub code path (datasets.load_dataset) on testdata/hub/<name>/, rows in the layout (field
    names, types) of each Hub copy: every benchmark maps to the same problems and golds as its local
    file."""
    # math-ai/aime24: the solution's last box or its bare text
    hub_golds = {"aime24": ["24", "56", "9"]}
    for name, spec in BENCHMARKS.items():
        monkeypatch.setitem(BENCHMARKS, name,
                            replace(spec, hub_id=str(TESTDATA / "hub" / name), hub_config=None))
        hub, local = load_benchmark(name), load_benchmark(name, DATA)
        assert [r["problem"] for r in hub] == [r["problem"] for r in local], name
        assert [r["gold"] for r in hub] == hub_golds.get(name, [r["gold"] for r in local]), name
    assert {k: v for k, v in load_benchmark("amc23")[0].items() if k != "fields"} == {
        "problem": "What is $1+2+3+\\cdots+10$?", "answer": "55.0", "gold": "55.0"}
    # the row as read
    assert load_benchmark("amc23")[0]["fields"]["question"] == "What is $1+2+3+\\cdots+10$?"
    assert load_benchmark("olympiadbench")[1]["gold"] == ["$2$,$-2$"]  # a list column stays one
