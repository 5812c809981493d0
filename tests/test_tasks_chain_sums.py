"""tasks/chain_sums.py: the chain-sums task (worked answers, prompts, the reward of the first block,
its data file).
"""
from data import read_jsonl
from tests.toy_task import ROOT


# ==================================================================================================
# tasks/chain_sums.py
# ==================================================================================================
def test_chain_sums_task(tmp_path):
    """tasks/chain_sums.py: worked answers, prompts of three examples and a question, the reward of
    the first block only (not of the examples the model goes on to invent), and a data file its
    generator reproduces."""
    from tasks import chain_sums

    assert chain_sums.worked((3, 5, 2)) == "3 + 5 = 8, 8 + 2 = 10. The answer is 10."
    row = chain_sums.problem((1, 2, 4))
    assert row["answer"] == "7" and row["prompt"].endswith("\n\nQ: 1 + 2 + 4 = ?\nA:")
    assert row["prompt"].count("The answer is") == 3
    right, wrong = (" 1 + 2 = 3, 3 + 4 = 7. The answer is 7.",
                    " 1 + 2 = 3, 3 + 4 = 8. The answer is 8.")
    assert chain_sums.reward(right + "\n\nQ: 2 + 2 + 2 = ?\nA: The answer is 6.", "7") == 1
    assert chain_sums.reward(wrong + "\n\nQ: 1 + 2 + 4 = ?\nA: The answer is 7.", "7") == -1
    chain_sums.main(tmp_path / "sums.jsonl")
    assert (tmp_path / "sums.jsonl").read_text() == \
        (ROOT / "tasks" / "chain_sums.jsonl").read_text()
    rows = [row for _, row in read_jsonl(str(ROOT / "tasks" / "chain_sums.jsonl"))]
    assert len(rows) == 726 == len({r["prompt"] for r in rows})
