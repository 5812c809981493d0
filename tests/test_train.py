"""train.py: the training loop end to end (learning, token budgets, packed rows, on policy, console
and samples, one-line errors, every algorithm, a policy on another device than the rollout engine,
--entropy-change, MKL). Its runs across one folder: tests/test_train_resume.py; on 2 processes:
tests/test_train_distributed.py.
"""
import json
import math
import os
import subprocess
import sys
import warnings
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import config
import eval as ev
import model
import reward
import rollout
import s2t
import stapo
import train
from command_line import errors
from data import heldout_count, load_rows, read_rows
from engines import choice, plain_engine
from model import Policy, tiny_model, tiny_tokenizer
from reports import summary
from rollout import format_prompt
from step_metrics import step_log
from step_metrics.watch import Watch
from tests.model_batches import packing_batch
from tests.toy_task import (
    ANSWER,
    BUDGET_KEYS,
    EVEN,
    EVERY_ALGO,
    ROOT,
    TOY_VOCAB,
    budget_args,
    one_line_error,
    one_thread,
    patch_toy_task,
    read_metrics,
    same_update,
    tensors_close,
    toy_args,
    toy_data,
    toy_run,
    varied_data,
)


# ==================================================================================================
# train.py: the training loop end to end
# ==================================================================================================
@pytest.mark.parametrize("algo", ["stapo", "justrl"])
def test_train_learns_toy_sum(tmp_path, monkeypatch, algo):
    """From reward alone, a random tiny model learns to answer one-digit sums well above chance
    (~7%)."""
    patch_toy_task(monkeypatch, ANSWER)
    args = toy_args(toy_data(tmp_path), tmp_path / algo, algo=algo, steps=40, prompts_per_step=32,
                    group_size=8, mini_batch_prompts=16, max_response_len=2, lr=3e-3,
                    rollout_chunk=0, export_hf=False)
    with one_thread():
        assert train.main(args) == 0
    acc = [m["reward/acc"] for m in read_metrics(tmp_path / algo)]
    assert sum(acc[:3]) / 3 < 0.15 and sum(acc[-5:]) / 5 > 0.3, acc


def test_train_token_budget_does_not_change_update(tmp_path, monkeypatch):
    """Every algorithm: token budgets 9 (below the longest row, up to 14 tokens: those run alone)
    and 10^6 (one micro-batch) give the losses and parameters of budget 1 (one row per micro-batch);
    padding (attention layouts, < 10%) and the prompts computed once (more in larger micro-batches)
    are reported."""
    patch_toy_task(monkeypatch, EVEN)
    data = varied_data(tmp_path)
    with one_thread():
        for algo, flags in EVERY_ALGO:
            for budget in (1, 9, 10**6):
                assert train.main(budget_args(data, tmp_path / f"{algo}-{budget}", algo,
                                              flags, budget)) == 0
            for budget in (9, 10**6):
                same_update(tmp_path / f"{algo}-1", tmp_path / f"{algo}-{budget}")
            first = [read_metrics(tmp_path / f"{algo}-{budget}")[0] for budget in (1, 9, 10**6)]
            pad, shared = [m["batch/pad_frac"] for m in first], \
                [m["batch/shared_frac"] for m in first]
            assert pad[0] == 0 and 0 <= min(pad) and max(pad) < 0.1, pad  # one row each: no padding
            # one row each: none
            assert shared[0] == 0 and shared[1] <= shared[2] and 0 < shared[2] < 0.9, shared


def _rows_one_by_one(lm, batch, temperature):
    """(logprobs, entropy), each (B, T): every row alone through the plain HF model (no packing, no
    padding)."""
    logprobs, entropy = torch.zeros(batch.response_ids.shape), torch.zeros(batch.response_ids.shape)
    for i in range(len(batch)):
        ids = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i].bool()],
                         batch.response_ids[i][batch.response_mask[i].bool()]])[None]  # (1, l)
        n, p = int(batch.response_mask[i].sum()), int(batch.prompt_mask[i].sum())
        logp = (lm(input_ids=ids).logits[0, p - 1:-1] / temperature).log_softmax(-1)  # (n, V)
        logprobs[i, :n] = logp.gather(1, ids[0, p:, None])[:, 0]
        entropy[i, :n] = -(logp.exp() * logp).sum(-1).detach()
    return logprobs, entropy


@pytest.mark.parametrize("algo", stapo.ALGORITHMS)
def test_train_packed_rows_match_each_row_alone(algo):
    """Every algorithm: the gradient `train.accumulate_gradients` accumulates with rows packed into
    micro-batches (model.Policy: one row of real tokens, a shared prompt once, attention kept within
    each sequence; budgets 10**6 = all rows in one packed row, 16, 1 = one row each) = the
    independent computation with each row alone through the plain HF model and the loss of
    stapo.policy_loss on it: the same loss and gradients."""
    torch.manual_seed(0)
    lm = tiny_model()
    policy, batch, T = Policy(lm), packing_batch(), 0.8
    cfg = config.Config(algo=algo, temperature=T, tau_p=0.2,
                        kl_beta=0.04 if algo == "grpo" else 0.0)
    g = torch.Generator().manual_seed(1)
    mask = batch.response_mask.float()
    logprobs, entropy = _rows_one_by_one(lm, batch, T)
    # ratios away from 1: clipping
    old = (logprobs.detach() + 0.15 * torch.randn(mask.shape, generator=g)) * mask
    ref = (logprobs.detach() + 0.1 * torch.randn(mask.shape, generator=g)) * mask \
        if algo == "grpo" else None
    adv = stapo.group_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0]), 3)[:, None] \
        .expand_as(mask)
    weights, _, _, den, _ = stapo.token_weights(algo, logprobs.detach(), entropy, adv, mask,
                                                cfg.tau_p, cfg.quantile)
    clip = stapo.clip_range(cfg.algo, cfg.clip_low, cfg.clip_high)
    want, _ = stapo.policy_loss(logprobs, old, adv, weights, *clip, cfg.dual_clip, den)
    if ref is not None:
        want = want + cfg.kl_beta * (weights * stapo.kl_k3(logprobs, ref)).sum() / den  # I k3 / N
    want_grads = torch.autograd.grad(want, list(lm.parameters()))
    assert sum(g.abs().sum() for g in want_grads) > 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for budget in (10**6, 16, 1):
            run = SimpleNamespace(cfg=replace(cfg, max_tokens_per_micro_batch=budget),
                                  device=torch.device("cpu"), policy=policy, world=1,
                                  on_policy=False)
            lm.zero_grad(set_to_none=True)
            mb = train.MiniBatch(batch, adv, model.TokenStats(old, None, None), ref,
                                 torch.ones(len(batch), dtype=torch.bool),
                                 stapo.MiniBatchContext())
            loss = train.accumulate_gradients(run, mb, weights, float(den)).loss
            assert loss == pytest.approx(want.item(), abs=1e-6), budget  # the KL term included
            for p_, w_ in zip(lm.parameters(), want_grads):
                torch.testing.assert_close(p_.grad, w_, atol=1e-6, rtol=1e-4)
    finally:
        dist.destroy_process_group()


def test_train_on_policy_forward_stands_in_for_the_pi_old_pass(tmp_path, monkeypatch):
    """One mini-batch per step with JustRL and GRPO (weights that need no p or H): no pi_old pass
    (token_stats runs for GRPO's reference model only), the update's own forward fills pi_old in,
    and two steps train to the metrics and parameters of the same runs with the pass (`on_policy`
    off); a step whose groups all tie (no forward) makes the pass after all. STAPO (p, H before the
    loss) keeps it."""
    patch_toy_task(monkeypatch, EVEN)
    data = varied_data(tmp_path)
    calls, token_stats = [], train.token_stats
    monkeypatch.setattr(train, "token_stats", lambda *a: calls.append(1) or token_stats(*a))
    keys = BUDGET_KEYS + ("rollout/logprob_diff", "updates")
    with one_thread():
        for algo, flags, passes in [("justrl", {}, 0), ("grpo", {"kl_beta": 0.04}, 2),
                                    ("stapo", {}, 2)]:
            runs = {}
            for name, fused in (("fused", None), ("pass", False)):
                with monkeypatch.context() as m:
                    if fused is not None:
                        m.setattr(train, "on_policy", lambda cfg: False)
                    calls.clear()
                    out = tmp_path / f"{algo}-{name}"
                    assert train.main(budget_args(data, out, algo, flags | {"mini_batch_prompts": 4,
                                                                            "steps": 2}, 9)) == 0
                    runs[name] = (out, len(calls))
            assert runs["fused"][1] == passes and runs["pass"][1] == 2 + (algo == "grpo") * 2, \
                (algo, runs)
            for a, b in zip(read_metrics(runs["fused"][0]), read_metrics(runs["pass"][0])):
                assert a["updates"] == 1
                for key in keys:
                    assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (algo, key)
            tensors_close(load_file(runs["fused"][0] / "hf" / "model.safetensors"),
                   load_file(runs["pass"][0] / "hf" / "model.safetensors"), atol=1e-5)
        # every group ties
        monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0)
        calls.clear()
        assert train.main(budget_args(data, tmp_path / "tied", "justrl",
                                      {"mini_batch_prompts": 4}, 9)) == 0
        tied = read_metrics(tmp_path / "tied")[0]
        assert len(calls) == 1 and tied["updates"] == 0 and tied["skipped/zero_adv"] == 1
        assert tied["entropy/mean"] > 0 and tied["rollout/logprob_diff"] < 1e-4


def test_train_cpu_turns_on_deterministic_kernels(tmp_path, monkeypatch):
    """On CPU train.py turns on PyTorch's deterministic kernels (warn only). Without them two runs
    of the CPU default at 2 threads had equal losses but different gradients in their first
    mini-batch, and drifted apart; with them the gradients were equal bit for bit (1 thread was
    always equal)."""
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        patch_toy_task(monkeypatch, EVEN)
        with one_thread():
            assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", steps=1)) == 0
        assert torch.are_deterministic_algorithms_enabled() and \
            torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_train_console_units_and_the_final_bar_once(tmp_path, monkeypatch, capsys):
    """What the console says, in one unit each: KV caches in GiB (the GB of --kv-cache-gb
    converted), the memory estimate named an upper bound (no module path), the held-out accuracy as
    a fraction and as eval.py's percentage, the bar's silenced tokens as a count; the final progress
    bar on one line, not redrawn under the closing lines; --help names the cpu preset beside the
    paper's recipe, eval.py's --data-dir a folder the repository has. (GB beside GiB, 0.087 beside
    eval.py's 8.75, silenced=3.4e-03 beside counts, the final bar 2-3 times.)"""
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", steps=2, heldout=2,
                                   export_hf=False, rollout_chunk=0)) == 0
    out, err = capsys.readouterr()
    # one KV-cache figure, the memory line's (the rollout line had a second, sized otherwise)
    assert ("rollout (plain): 4 prompts x G 4 per generate call on each rank (--kv-cache-gb 40 = "
            "37.25 GiB holds their KV cache at --max-prompt-len)") in out, out
    memory = next(x for x in out.splitlines() if x.startswith("memory per rank"))
    assert memory.startswith("memory per rank, estimated with every row at its longest (an upper "
                             "bound): training ") and out.count("KV cache (") == 1
    assert "memory.estimate" not in out and "Writing model shards" not in err
    acc = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[0])["eval/acc"]
    assert (f"held-out accuracy before training: {acc:.4f} = {100 * acc:.2f}% as eval.py reports "
            f"it (8 samples)") in out
    # a terminal line: \r redraws in place
    finals = [line for line in err.split("\n") if "2/2 [" in line]
    assert len(finals) == 1 and finals[0].split("silenced=")[-1].split("]")[0].isdigit(), \
        err[-3000:]
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0 and \
        "without CUDA the cpu preset" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    assert "like the repository's testdata/benchmarks" in " ".join(capsys.readouterr().out.split())


def test_train_heldout_prompts_longer_than_max_prompt_len_are_dropped_and_counted(
        tmp_path, monkeypatch, capsys):
    """Both splits are held to --max-prompt-len, and the console says how many prompts each lost; a
    problem with more characters than 50 tokens can spell is dropped before it is tokenized. (A
    100k-character held-out prompt reached the sampler: an attempt to allocate 250 GB after 43 s;
    a 20 MB row took 11 GB and 74 s to tokenize.)"""
    patch_toy_task(monkeypatch, EVEN)
    rows = [{"prompt": f"{a}{b}", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]
    rows[7]["prompt"] = "1" * 100_000  # --seed shuffles the data's order: find where row 7 goes
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    heldout = order.index(7) + 1  # row 7 is the last held-out row
    rows[order[heldout]]["prompt"] = "2" * 1_000_000  # a training row
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized, format_prompt = [], rollout.format_prompt
    monkeypatch.setattr(rollout, "format_prompt", lambda tok, problem, *a:
                        tokenized.append(len(problem)) or format_prompt(tok, problem, *a))
    with one_thread():
        assert train.main(toy_args(str(path), tmp_path / "run", heldout=heldout, max_prompt_len=50,
                                    export_hf=False)) == 0
    assert max(tokenized) <= 50 * len("<|endoftext|>")  # the tiny tokenizer's longest token
    assert (f"train.py: dropped 1 of {len(rows) - heldout} training prompts and 1 of {heldout} "
            f"held-out prompts longer than --max-prompt-len 50 tokens") in capsys.readouterr().err
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/n"] for e in evals] == [4 * (heldout - 1)] * 2


def test_train_holds_out_a_tenth_of_your_data_by_default_or_says_there_is_none(
        tmp_path, monkeypatch, capsys):
    """Without --heldout, a tenth of --data's rows (at most 20) is held out and evaluated before and
    after training, and eval.py --run finds the same rows; data too small for that trains on every
    row, and the closing line says there is no held-out evaluation and how to get one instead of
    listing an empty eval.jsonl. (The default was 0: no accuracy before and after, and an empty
    eval.jsonl among the outputs.)"""
    patch_toy_task(monkeypatch, EVEN)
    assert [heldout_count(n, None) for n in (9, 10, 55, 199, 10_000)] == [0, 1, 5, 19, 20]
    assert heldout_count(55, 0) == 0 and heldout_count(55, 7) == 7
    data = toy_data(tmp_path)  # 55 rows
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "run", heldout=None, export_hf=False)) == 0
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["eval/n"]) for e in evals] == [(0, 5 * 4), (1, 5 * 4)]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    train_rows, heldout, _ = load_rows(SimpleNamespace(**config))
    # the count it held out, not --heldout's null
    assert config["heldout"] == 5 and len(heldout) == 5 and len(train_rows) == 50
    out = capsys.readouterr().out
    assert "held-out accuracy before training" in out and "no held-out evaluation" not in out
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"{a}{a}", "answer": str(2 * a)}) + "\n"
                             for a in range(5)))
    with one_thread():
        assert train.main(toy_args(str(small), tmp_path / "small", heldout=None,
                                   export_hf=False)) == 0
    out = capsys.readouterr().out
    assert (f"no held-out evaluation: no held-out rows (--heldout N keeps N rows of {small} out of "
            f"training)" in out), out
    closing = next(x for x in out.splitlines() if "outputs in" in x)
    assert "eval.jsonl" not in closing and "metrics.jsonl" in closing, closing


def test_train_and_eval_unreadable_data_are_one_line_errors(tmp_path, capsys):
    """Empty, malformed and non-UTF-8 data files: one line naming the file (and the line), exit 2,
    in train.py and eval.py --data. (They were 27-line tracebacks from inside datasets, or named
    neither file nor row.)"""
    files = {"empty.jsonl": b"", "empty.json": b"",
             "bad.jsonl": b'{"prompt": "12", "answer": "3"}\n{"prompt": \n',
             "latin1.jsonl": b'{"prompt": "12", "answer": "3"}\n'
                             b'{"prompt": "caf\xe9", "answer": "3"}\n',
             "list.jsonl": b"[1, 2]\n", "bad.json": b"{not json",
             "deep.jsonl": b"[" * 200_000 + b"]" * 200_000}
    expected = {"empty.jsonl": "empty.jsonl: no rows",
                "empty.json": "empty.json: not a readable json file",
                "bad.jsonl": "bad.jsonl line 2: not JSON (Expecting value at character 13)",
                "latin1.jsonl": "latin1.jsonl line 2: not UTF-8 "
                                "(invalid continuation byte at byte 15)",
                "list.jsonl": "list.jsonl line 1: not a JSON object",
                "bad.json": "bad.json: not a readable json file",
                # it was a RecursionError traceback
                "deep.jsonl": "deep.jsonl line 1: nested too deeply to read"}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        assert train.main(toy_args(str(tmp_path / name), tmp_path / "o")) == 2
        one_line_error(capsys, expected[name])
        with pytest.raises(SystemExit) as e:
            ev.main(["--models", "tiny", "--data", str(tmp_path / name), "--prompt-key", "prompt",
                     "--out", str(tmp_path / "e")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and expected[name] in err[0], err
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()


def test_train_bad_out_dir_and_float_flags_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """An --out-dir that cannot be made (under a file) or written, is empty or holds a newline, and
    a float flag that overflows float32 (--lr 1e39: an OverflowError inside AdamW), are refused
    before anything loads."""
    data = toy_data(tmp_path)
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("startup.run.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(toy_args(data, tmp_path / "file" / "run")) == 2
    one_line_error(capsys, f"--out-dir {tmp_path / 'file' / 'run'} cannot be made: "
                           f"{tmp_path / 'file'} is a file")
    # it wrote into the working directory
    assert train.main(toy_args(data, tmp_path / "run", out_dir="")) == 2
    one_line_error(capsys, "--out-dir '' names no folder: give one, e.g. --out-dir out/run")
    # it split the stop line
    assert train.main(toy_args(data, tmp_path / "run", out_dir=f"{tmp_path}/a\nb")) == 2
    one_line_error(capsys, f"--out-dir '{tmp_path}/a\\nb' holds a control character: "
                           "name the folder without one")
    for flags, expected in (({"lr": 1e39}, "--lr 1e+39 is not a finite float32"),
                            ({"weight_decay": float("nan")},
                             "--weight-decay nan is not a finite float32")):
        assert train.main(toy_args(data, tmp_path / "run", **flags)) == 2
        one_line_error(capsys, expected)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")
    # root ignores chmod: a read-only mount
    monkeypatch.setattr(errors.tempfile, "TemporaryFile", read_only)
    assert train.main(toy_args(data, tmp_path / "run")) == 2
    one_line_error(capsys, f"--out-dir {tmp_path / 'run'} cannot be written: Read-only file system")
    assert not (tmp_path / "run").exists()


def test_train_diverged_run_says_so_at_the_end(tmp_path, monkeypatch, capsys):
    """--lr 1e3: the first update blows the weights up and later steps skip every update (non-finite
    gradient norm). The run ends with a warning and the closing line naming the steps as
    metrics.jsonl numbers them (from 1). (It ended with exit 0 and said nothing; the skip warnings
    counted steps from 0.)"""
    patch_toy_task(monkeypatch, EVEN)
    with one_thread(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", steps=4, lr=1e3,
                                   export_hf=False)) == 0
    bad = [m["step"] for m in read_metrics(tmp_path / "run") if m["skipped/nonfinite"] > 0]
    assert bad and bad[0] > 1, bad
    err = capsys.readouterr().err
    assert (f"train.py: warning: the run diverged: the gradient norm was not finite in {len(bad)} "
            "steps of 4 ") in err
    assert "lower --lr" in err
    # numbered as metrics.jsonl
    assert any(f"step {bad[0]} mini-batch" in str(w.message) for w in caught)


def test_train_bad_inputs_one_line_error(tmp_path, capsys):
    data = toy_data(tmp_path)
    bad_row = tmp_path / "bad.jsonl"
    bad_row.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    cases = {
        "data file not found": toy_args(str(tmp_path / "missing.jsonl"), tmp_path / "o"),
        "bad.jsonl line 2: no answer in field 'answer'": toy_args(str(bad_row), tmp_path / "o"),
        "unknown --algo 'ppo'": toy_args(data, tmp_path / "o", algo="ppo"),
        "model directory not found": toy_args(data, tmp_path / "o", model="./no/such/model"),
        "--temperature must be > 0": toy_args(data, tmp_path / "o", temperature=0),
    }
    for expected, args in cases.items():
        assert train.main(args) == 2, expected
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and err[0].startswith("train.py: error:"), \
            (expected, err)
    # the same from a shell: exit status 2, one line on stderr, no traceback
    proc = subprocess.run([sys.executable, "train.py"] + cases["data file not found"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.strip()] == \
        [x for x in proc.stderr.splitlines() if "error" in x]


def test_train_wrong_model_offline_is_one_line_before_the_folder(tmp_path, monkeypatch, capsys):
    """A mistyped --model with the Hub off: one line naming what --model accepts, without asking
    the Hub, before the run folder opens (no config.json, no run.lock). It took 27 s of the Hub's
    retries and left both."""
    import huggingface_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda *a, **k: pytest.fail("the Hub was asked"))
    out = tmp_path / "o"
    assert train.main(toy_args(toy_data(tmp_path), out, model="smolm2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: --model 'smolm2' is not in the "
                                               "local Hub cache") and "smollm2, tiny" in err[0]
    assert not out.exists()


def test_train_skips_zero_advantage_and_nonfinite_steps(tmp_path, monkeypatch, capsys):
    """All-equal rewards skip every update and say so on the console; a NaN loss skips the update
    with a warning; the run finishes."""
    data = toy_data(tmp_path)
    patch_toy_task(monkeypatch, EVEN)
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "zero")) == 0
    zero = read_metrics(tmp_path / "zero")[0]
    assert zero["skipped/zero_adv"] == 2 and zero["updates"] == 0 and zero["adv/zero_frac"] == 1.0
    assert ("train.py: warning: step 1: every response was right, so the policy gradient is zero "
            "and no update was made; use harder data") in capsys.readouterr().err
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": -1.0)  # all wrong
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "wrong")) == 0
    assert ("train.py: warning: step 1: in every group the 4 responses had equal rewards "
            "(train_acc 0.00), so the policy gradient is zero and no update was made; use easier "
            "data, a larger --group-size or a higher --temperature") in capsys.readouterr().err

    patch_toy_task(monkeypatch, EVEN)
    policy_loss = train.stapo.policy_loss
    monkeypatch.setattr(train.stapo, "policy_loss", lambda *a, **k:
                        (policy_loss(*a, **k)[0] * float("nan"), policy_loss(*a, **k)[1]))
    with one_thread(), pytest.warns(UserWarning, match="non-finite gradient norm"):
        assert train.main(toy_args(data, tmp_path / "nan", steps=2)) == 0
    nan = read_metrics(tmp_path / "nan")
    assert [m["skipped/nonfinite"] for m in nan] == [2, 2] and all(m["updates"] == 0 for m in nan)
    # parameters untouched (no step, no decay)
    tensors_close(load_file(tmp_path / "nan" / "hf" / "model.safetensors"),
                  tiny_model(vocab_size=TOY_VOCAB).state_dict(), atol=0)


@pytest.mark.parametrize("algo,flags", [("grpo", {"kl_beta": 0.04}), ("20-entropy", {}),
                                        ("fullmask", {}),
                                        ("stapo", {"dual_clip": 10.0, "grad_checkpointing": True})])
def test_train_every_algorithm_runs(tmp_path, monkeypatch, algo, flags):
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", algo=algo, export_hf=False,
                                   **flags)) == 0
    m = read_metrics(tmp_path / "run")[0]
    assert m["updates"] == 2 and math.isfinite(m["loss/policy"])
    # two mini-batches: the ratio is exactly 1 on the first and moved on the second
    assert m["ratio/mean"] != 1.0 and abs(m["ratio/mean"] - 1) < 0.5 and m["kl/approx"] > 0
    if algo == "20-entropy":  # keeps the top 20% entropies: about 80% of response tokens silenced
        assert 0.6 < m["s2t/silenced_frac"] < 0.9
    if algo == "grpo":
        assert m["loss/kl"] >= 0


# ------------------------------------------------------------ a second device, simulated on the CPU
# CUDA-only crashes come from tensors of two devices meeting in one op (a CUDA output written into a
# CPU buffer). On a CPU-only machine a second device is simulated: `OnOther` tensors hold CPU data
# but say they live on `meta` (standing for an accelerator), factories asked for `meta` make them,
# and an op that mixes them with CPU tensors raises as CUDA does (0-dim CPU tensors mix freely;
# copies and .to() cross; CPU index tensors may index them).
_aten = torch.ops.aten
_CROSSING = {_aten.copy_.default, _aten._to_copy.default, _aten._local_scalar_dense.default}
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default}
_OTHER = torch.device("meta")


class OnOther(torch.Tensor):
    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   dtype=data.dtype, device=_OTHER,
                                                   requires_grad=data.requires_grad,
                                                   storage_offset=data.storage_offset())

    def __init__(self, data):
        self.inner = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _second_device_op(func, args, kwargs or {})


def _second_device_op(func, args, kwargs):
    from torch.utils._pytree import tree_flatten, tree_map

    def where(x):
        return "other" if isinstance(x, OnOther) else "cpu"

    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    # self and values must agree; indices may be CPU tensors, not other-device ones of CPU self
    if func in _INDEXING:
        if where(args[0]) == "cpu" and any(where(i) == "other" for i in args[1] if i is not None):
            raise RuntimeError(f"{func}: indices on another device than the indexed CPU tensor")
        tensors = [args[0], *(x for x in args[2:3] if isinstance(x, torch.Tensor))]
    if func not in _CROSSING and \
            len({where(x) for x in tensors if where(x) == "other" or x.dim() > 0}) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found the CPU and "
                           f"another ({func})")
    device = kwargs.get("device")
    kwargs = {k: torch.device("cpu") if k == "device" and v is not None and
              torch.device(v) == _OTHER else v for k, v in kwargs.items()}
    unwrap = lambda x: x.inner if isinstance(x, OnOther) else x  # noqa: E731
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if func._schema.is_mutable:  # in place: its first argument
        return args[0]
    other = (torch.device(device) == _OTHER if device is not None else
             func is not _aten._local_scalar_dense.default and
             any(where(x) == "other" for x in tensors))
    return tree_map(lambda x: OnOther(x) if other and isinstance(x, torch.Tensor) else x, out)


class _OtherDeviceOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _second_device_op(func, args, kwargs or {})


class _OtherDeviceData(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None and \
                torch.device(kwargs["device"]) == _OTHER:  # both bypass the dispatcher's factories
            return OnOther(func(*args, **{**kwargs, "device": "cpu"}))
        if func is torch.Tensor.tolist and isinstance(args[0], OnOther):  # a host copy, as on CUDA
            return args[0].inner.tolist()
        return func(*args, **kwargs)


@contextmanager
def _SecondDevice():
    """While active, tensors asked for on `meta` are OnOther tensors, and every op follows the rules
    above."""
    with _OtherDeviceData(), _OtherDeviceOps():
        yield


def test_second_device_simulation_raises_like_cuda():
    """The simulation itself: mixing fails where CUDA fails, and works where CUDA works."""
    with _SecondDevice():
        x = torch.arange(4.0, device=_OTHER)  # (4,) on the other device
        assert isinstance(x, OnOther) and x.device == _OTHER and (x * 2).sum().item() == 12.0
        cpu = torch.zeros(4)
        for bad in (lambda: cpu + x, lambda: cpu.__setitem__(torch.tensor([0, 1]), x[:2]),
                    lambda: torch.cat([cpu, x]), lambda: cpu[torch.tensor([0], device=_OTHER)],
                    lambda: cpu[torch.zeros(4, device=_OTHER) > 0]):
            with pytest.raises(RuntimeError):
                bad()
        # CPU indices index another device's tensor
        assert x[torch.tensor([1, 2])].cpu().tolist() == [1.0, 2.0]
        # a 0-dim CPU tensor mixes
        assert (x + torch.tensor(1.0)).cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
        cpu.copy_(x)
        assert cpu.tolist() == [0.0, 1.0, 2.0, 3.0] and not isinstance(x.cpu(), OnOther)


class _CPUCopyEngine(plain_engine.PlainEngine):
    """An engine with vLLM's contract: its own copy of the weights (pushed in `ready`), batches on
    the CPU."""

    @contextmanager
    def ready(self, policy):
        self.lm.load_state_dict({k: v.cpu() for k, v in policy.lm.state_dict().items()})
        yield self


def test_train_policy_on_another_device_than_the_rollout_engine(tmp_path, monkeypatch):
    """The policy on a second device, the rollout engine's batches on the CPU (as vLLM's are): a
    whole run (rollout, pi_old and p/H passes, S2T, GRPO's reference model and KL, TIS, two updates,
    held-out evaluation, checkpoint, export) makes no op that mixes devices. (token_stats wrote the
    policy's outputs into a buffer on the batch's device: --rollout vllm crashed at step 1 on
    CUDA.)"""
    patch_toy_task(monkeypatch, EVEN)
    start = train.init_distributed
    monkeypatch.setattr(train, "init_distributed", lambda timeout_min=60: (*start()[:2], _OTHER))
    monkeypatch.setattr("startup.run.load_model", lambda name, device=None, **kw: (
        tiny_model(vocab_size=TOY_VOCAB)._apply(OnOther if device == _OTHER else lambda t: t),
        tiny_tokenizer()))
    monkeypatch.setattr(choice, "make_engine", lambda name, lm, tokenizer, chat, stop=None, **kw:
                        _CPUCopyEngine(tiny_model(vocab_size=TOY_VOCAB),
                                       rollout.eos_ids(lm, tokenizer, chat), tokenizer.pad_token_id,
                                       TOY_VOCAB))
    # the fused kernel refuses the simulated device (meta); the update is the same
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW",
                        lambda params, **kw: adamw(params, **{**kw, "fused": False}))
    data = varied_data(tmp_path)
    with one_thread(), _SecondDevice():
        # the others: stapo.py only
        for algo, flags in [("stapo", {"tis_cap": 2.0}), ("grpo", {"kl_beta": 0.04})]:
            out = tmp_path / algo
            assert train.main(budget_args(data, out, algo, flags, 9) + ["--heldout", "2"]) == 0
            assert read_metrics(out)[0]["updates"] == 2 and \
                (out / "hf" / "model.safetensors").is_file()


# ---------------------------------------------------------------- samples.jsonl and the console

def test_train_samples_file_and_console(tmp_path, monkeypatch, capsys):
    """samples.jsonl: --samples-per-step completions per step and per held-out evaluation, each with
    the prompt the model saw and the reward it got; the console: eval lines on their own, "1 step",
    a final line naming outputs."""
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", heldout=2,
                                   samples_per_step=3)) == 0
    out = capsys.readouterr().out.splitlines()
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in samples] == \
        [(0, "heldout")] * 2 + [(1, "train")] * 3 + [(1, "heldout")] * 2
    tokenizer, even = tiny_tokenizer(), ("0", "2", "4", "6", "8")
    rows = {r["problem"]: r["answer"]
            for r in read_rows(str(tmp_path / "toy.jsonl"), "prompt", "answer")[0]}
    for r in samples:
        problem = next(p for p in rows
                       if tokenizer.decode(format_prompt(tokenizer, p, False, "")) == r["prompt"])
        assert r["answer"] == rows[problem]
        if r["split"] == "train":  # the toy reward of the test: +1 for an even first character
            assert r["reward"] == (1.0 if r["response"].strip()[:1] in even else -1.0)
        else:  # held out: the same reward (it was 1.0 / 0.0, correct or not; training rows: +-1)
            assert r["reward"] == (1.0 if r["response"].strip()[:1] in even else -1.0)
    assert [x.split(":")[0] for x in out if x.startswith("held-out")] == [
        "held-out accuracy before training", "held-out accuracy after 1 step"]
    metrics = read_metrics(tmp_path / "run")
    # plain closing lines: RQ1's Spearman correlations are gradient.png's and --plot's
    assert out[-2].startswith(f"stapo silenced {int(metrics[0]['s2t/silenced'])} tokens in ")
    assert not any("Spearman" in line for line in out)
    steps = [{"s2t/silenced": 3.0, "s2t/candidates": 5.0},
             {"s2t/silenced": 0.0, "s2t/candidates": 1.0},
             {"s2t/silenced": 2.0, "s2t/candidates": 2.0}]
    assert summary.silenced_summary("stapo", steps, ["spurious.jsonl", "s2t.png"]) == (
        "stapo silenced 5 tokens in 2 of 3 steps, of 8 candidates (tokens of correct answers with "
        "p < tau_p); see spurious.jsonl, s2t.png")
    assert summary.silenced_summary("justrl", [], []) == (
        "justrl silenced 0 tokens in 0 of 0 steps, of 0 candidates (tokens of correct answers with "
        "p < tau_p)")
    # a log without lines is never made
    logs = [n for n in ("config.json", "metrics.jsonl", "eval.jsonl", "samples.jsonl",
                        "spurious.jsonl", "tokens.jsonl") if (tmp_path / "run" / n).exists()]
    assert out[-1].startswith(f"outputs in {tmp_path / 'run'}/: {', '.join(logs)}, "
                              f"checkpoint/step_1, hf/ (python eval.py --run {tmp_path / 'run'})")


# -------------------------------------------------------------- the confirmatory experiment's flags
def test_train_stop_text_ends_responses_and_the_reward_reads_them_whole(tmp_path, monkeypatch):
    """--stop-text 3 --stop-text 45 (repeatable): every response that is not truncated and has no
    EOS ends with the token at which a stop text first appears, and nowhere before; the reward sees
    the whole text, that token included; config.json records the texts."""
    patch_toy_task(monkeypatch, EVEN)
    seen = []
    reward_fn = reward.reward
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo":
                        seen.append(response) or reward_fn(response, gold, mode))
    args = toy_args(toy_data(tmp_path), tmp_path / "run", max_response_len=8, export_hf=False)
    with one_thread():
        assert train.main(args + ["--stop-text", "3", "--stop-text", "45"]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["stop_text"] == ["3", "45"]
    ended = [t for t in seen if "3" in t or "45" in t]
    assert len(ended) > 4 and len(seen) == 16
    # the first appearance is at the end: the text without its last character holds none
    for text in ended:
        assert text.endswith(("3", "45")) and "3" not in text[:-1] and "45" not in text[:-1], text
    assert any(t.endswith("45") for t in ended)  # a match across two tokens
    assert read_metrics(tmp_path / "run")[0]["response/len_mean"] < 7


def test_train_gradient_share_leaves_the_update_and_measures_the_candidates(tmp_path, monkeypatch):
    """--gradient-share: the same losses and parameters as without it; with one mini-batch a step
    its norm of the whole objective is the gradient norm clip_grad_norm_ computed; the candidates'
    part and the rest obey the triangle inequality, and the candidates' part is not zero (tau_p 0.2:
    the toy model has many)."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    with one_thread():
        for name, flags in (("plain", []), ("share", ["--gradient-share"])):
            assert train.main(toy_args(data, tmp_path / name, mini_batch_prompts=4, tau_p=0.2,
                                       steps=2, max_response_len=6) + flags) == 0
    plain, share = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "share")
    for a, b in zip(plain, share):
        assert {k: v for k, v in a.items()
                if not k.startswith("time/") and k != "tokens_per_s"} == pytest.approx(
            {k: v for k, v in b.items()
             if not k.startswith(("time/", "grad_share/")) and k != "tokens_per_s"})
    tensors_close(load_file(tmp_path / "plain" / "hf" / "model.safetensors"),
           load_file(tmp_path / "share" / "hf" / "model.safetensors"), atol=0)
    for m in share:
        assert m["grad_share/n"] == 1 and \
            m["grad_share/all"] == pytest.approx(m["grad_norm"], rel=1e-5)
        g, g_c, rest = m["grad_share/all"], m["grad_share/candidates"], m["grad_share/without"]
        assert g_c > 0 and abs(g - rest) <= g_c * (1 + 1e-5) and g_c <= (g + rest) * (1 + 1e-5)


def test_train_quantile_window_resumes_exactly(tmp_path, monkeypatch):
    """--quantile-window 6: the window is kept in the checkpoint, so 2 steps and a resume to 3
    equal 3 steps at once, S2T's counts included; the window changes what S2T silences (against the
    paper's rule on the same rollouts of step 1) and s2t/rule_silenced counts what the rule
    silences, here equal to what STAPO silenced."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    common = dict(tau_p=0.2, max_response_len=6, export_hf=False)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3, quantile_window=6,
                                   **common)) == 0
        assert train.main(toy_args(data, tmp_path / "cut", steps=2, quantile_window=6,
                                   **common)) == 0
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "3"]) == 0
        assert train.main(toy_args(data, tmp_path / "paper", steps=3, **common)) == 0
    full, cut, paper = (read_metrics(tmp_path / n) for n in ("full", "cut", "paper"))
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[2].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[2].items() if k not in drop}, rel=1e-6, abs=1e-9)
    assert all(m["s2t/rule_silenced"] == m["s2t/silenced"] for m in full + paper)
    assert full[0]["s2t/candidates"] == paper[0]["s2t/candidates"]  # same first rollout and pi_old
    assert [m["s2t/silenced"] for m in full] != [m["s2t/silenced"] for m in paper]


def test_train_no_eval_before_and_the_evaluation_before_is_the_seeds(tmp_path, monkeypatch):
    """The evaluation before training depends on the seed and the initial model only, so runs of one
    seed sample it alike whatever --algo; --no-eval-before leaves it out (eval.jsonl then starts
    after the last step)."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    with one_thread():
        for algo in ("stapo", "justrl"):
            assert train.main(toy_args(data, tmp_path / algo, algo=algo, heldout=4,
                                       export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "none", heldout=4, export_hf=False,
                                   eval_before=False)) == 0
    evals = {n: [json.loads(x) for x in (tmp_path / n / "eval.jsonl").read_text().splitlines()]
             for n in ("stapo", "justrl", "none")}
    assert evals["stapo"][0]["step"] == 0 and evals["stapo"][0] == evals["justrl"][0]
    assert [e["step"] for e in evals["none"]] == [1]


def test_train_entropy_change_per_kind_of_token(tmp_path, monkeypatch):
    """--entropy-change logs the mean entropy change an update made at silenced tokens, kept
    candidates and other tokens. With lr 0 the policy does not move: every change is exactly 0 (the
    positions before and after are the same); with lr 1e-2 the update moves them; without the flag
    the keys are absent."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    keys = [f"entropy_change/{kind}" for kind in ("silenced", "candidate", "other")]
    with one_thread():
        for lr in (0.0, 1e-2):
            assert train.main(toy_args(data, tmp_path / f"lr{lr}", steps=2, lr=lr, tau_p=0.5,
                                       entropy_change=True, export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "off", steps=1, export_hf=False)) == 0
    still, moved = read_metrics(tmp_path / "lr0.0"), read_metrics(tmp_path / "lr0.01")
    assert sum(m["updates"] for m in still) > 0 and sum(m["s2t/silenced"] for m in still) > 0
    assert all(m[k] == 0.0 for m in still for k in keys), still
    assert any(m["entropy_change/other"] != 0.0 for m in moved)
    assert not any(k in read_metrics(tmp_path / "off")[0] for k in keys)
    # the kind x part split: shares of the gradient norm, tokens, entropy change
    for m in still + moved:
        tokens = m["response/len_mean"] * 16  # 4 prompts x G 4, each in one mini-batch
        assert sum(m[f"shares/n_{cell}"] for cell in step_log.CELLS) == pytest.approx(tokens)
        assert sum(m[f"shares/grad_{cell}"] for cell in step_log.CELLS) == pytest.approx(1.0)
    assert all(m[f"shares/dH_{cell}"] == 0.0 for m in still for cell in step_log.CELLS)
    assert any(m[f"shares/dH_{cell}"] != 0.0 for m in moved for cell in step_log.CELLS)


def test_train_sets_mkl_reproducibility_before_torch_loads():
    """train.py asks MKL for conditional numerical reproducibility before torch loads it: without
    it, SmolLM2's backward at 2 threads differed in the last bits from run to run (layers 0-20,
    1e-6), so a resumed CPU run drifted from the uninterrupted one
    (`python -m tools.bench preempt`); a value the user set is kept."""
    code = "import os, sys; import train; print(os.environ['MKL_CBWR'], 'torch' in sys.modules)"
    for env, expected in (({}, "AUTO,STRICT True"),
                          ({"MKL_CBWR": "COMPATIBLE"}, "COMPATIBLE True")):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | env
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                             env=env)
        assert out.stdout.strip() == expected, out.stderr[-2000:]
    source = (ROOT / "train.py").read_text()  # startup/early.py sets it; train.py imports it first
    assert source.index("from startup import early") < source.index("\nimport torch")
    assert 'os.environ.setdefault("MKL_CBWR"' in (ROOT / "startup" / "early.py").read_text()


# -------------------------------------------- a rank's rows of each mini-batch (train.mini_batches)

def test_train_mini_batches_place_each_rank_s_rows():
    """train.mini_batches: rank r of W holds rows r*b..r*b+b-1 of each mini-batch (rank_slice), so
    randmask's keys (stapo.MiniBatchContext: seeded from (seed, step, k), each row's by its
    place) are the same on any number of ranks; the mini-batches of a step and of two steps
    differ."""
    batch = packing_batch()  # 6 rows: this rank's 2 prompts x G = 3, 2 mini-batches of 3
    cfg = config.Config(seed=3, group_size=3, prompts_per_step=4, mini_batch_prompts=2,
                        max_response_len=8)
    pi_old = model.TokenStats(*(torch.zeros(6, 7) for _ in range(3)))

    def contexts(rank, step):
        run = SimpleNamespace(cfg=cfg, rank=rank, world=2, device=torch.device("cpu"),
                              ref_policy=None, window=None)
        return [mb.context for mb in train.mini_batches(run, step, batch, torch.ones(6),
                                                        torch.ones(6), pi_old)]

    for rank in range(2):
        mbs = contexts(rank, 2)
        assert [c.rows for c in mbs] == [range(3 * rank, 3 * rank + 3)] * 2
        assert [c.length for c in mbs] == [8, 8] and mbs[0].seed != mbs[1].seed
        assert [c.seed for c in mbs] == [c.seed for c in contexts(1 - rank, 2)]
        assert [c.seed for c in mbs] != [c.seed for c in contexts(rank, 3)]


# ------------------------------------------------ the metrics read the step's decision (watch.py)

@pytest.mark.parametrize("algo", ["stapo", "justrl", "randmask"])
def test_train_step_applies_the_s2t_rule_once_and_the_metrics_read_it(tmp_path, monkeypatch,
                                                                     algo):
    """One step of 2 mini-batches: S2T's rule runs once per mini-batch, with one all-gather of its
    candidates' entropies (the metrics line once ran it a second time, with a second all-gather),
    and s2t/rule_silenced counts the decision the step made (for STAPO also s2t/silenced)."""
    calls, gathers = [], []
    rule, gather = s2t.spurious_mask, train.all_gather_cat
    monkeypatch.setattr(s2t, "spurious_mask", lambda *a: calls.append(1) or rule(*a))
    monkeypatch.setattr(train, "all_gather_cat", lambda v: gathers.append(1) or gather(v))
    monkeypatch.setattr(step_log, "all_gather_cat", lambda v: gathers.append(1) or gather(v))
    decided = []

    class Decisions(Watch):
        def backward(self, k, mb, pi_theta, weights, update):
            decided.append(weights)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with one_thread():
            run = toy_run(tmp_path, monkeypatch, algo=algo)
            metrics = train.logged_step(run, 1, Decisions()).metrics
    finally:
        dist.destroy_process_group()
    assert len(decided) == 2 and len(calls) == 2, (len(decided), len(calls))
    assert len(gathers) == 2 + (algo == "randmask") * 4  # randmask: its count and keys, twice
    assert metrics["s2t/rule_silenced"] == sum(int(w.rule.sum()) for w in decided) > 0
    if algo == "stapo":
        assert metrics["s2t/silenced"] == metrics["s2t/rule_silenced"]
