"""Tests of train.py on CPU with the tiny random model: learning from reward alone, rank- and micro-batch-invariance
of the update (1 process vs torchrun 2 processes with FSDP2), exact resume, the Hugging Face export, bad inputs."""
import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import reward
import train
from model import Policy, tiny_model, tiny_tokenizer

ROOT = Path(__file__).parent
# The toy task: "ab" -> the digit a+b (sums <= 9). The tiny model gets a 14-row vocabulary: the 4 special tokens
# and the 10 digits (ids 0..13 of the tiny tokenizer), so a random model is right about 7% of the time.
_TOY_VOCAB = 14
_RUNNER = """import sys
sys.path.insert(0, {root!r})
import model, reward, train
reward.reward = lambda response, gold, mode="dapo": 1.0 if {check} else -1.0
train.lm_vocab_size = lambda tokenizer: {vocab}
train.load_model = lambda name, **kw: (model.tiny_model(vocab_size={vocab}), model.tiny_tokenizer())
sys.exit(train.main(sys.argv[1:]))
"""
_ANSWER = "response.strip()[:1] == gold"  # the first emitted character is the answer digit
_EVEN = "response.strip()[:1] in ('0', '2', '4', '6', '8')"  # ~1/2 right: mixed groups (for the equality tests)


def _toy_data(tmp_path: Path) -> str:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


def _toy_args(data: str, out: Path, **flags) -> list[str]:
    base = dict(model="tiny", data=data, answer_key="answer", instruction="", algo="stapo", steps=1,
                prompts_per_step=4, group_size=4, mini_batch_prompts=2, micro_batch_size=4, max_response_len=3,
                lr=1e-3, warmup_steps=0, rollout_chunk=1, save_every=0, out_dir=str(out), preset="cpu",
                plots=False)
    base.update(flags)
    args = ["--no-chat"]
    for key, value in base.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return args


def _patch(monkeypatch, check: str = _ANSWER) -> None:
    """The toy task in this process."""
    fn = {_ANSWER: lambda response, gold, mode="dapo": 1.0 if response.strip()[:1] == gold else -1.0,
          _EVEN: lambda response, gold, mode="dapo": 1.0 if response.strip()[:1] in ("0", "2", "4", "6", "8") else -1.0
          }[check]
    monkeypatch.setattr(reward, "reward", fn)
    monkeypatch.setattr(train, "lm_vocab_size", lambda tokenizer: _TOY_VOCAB)
    monkeypatch.setattr(train, "load_model", lambda name, **kw: (tiny_model(vocab_size=_TOY_VOCAB), tiny_tokenizer()))


@contextmanager
def _one_thread():
    """One intra-op thread while training the tiny model: its tiny ops are ~20x faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, args: list[str], nproc: int = 1, check: str = _EVEN) -> None:
    runner = tmp_path / "runner.py"
    runner.write_text(_RUNNER.format(root=str(ROOT), check=check, vocab=_TOY_VOCAB))
    cmd = [sys.executable, str(runner)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(runner)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.mark.parametrize("algo", ["stapo", "justrl"])
def test_train_learns_toy_sum(tmp_path, monkeypatch, algo):
    """From reward alone, a random tiny model learns to answer one-digit sums well above chance (~7%)."""
    _patch(monkeypatch, _ANSWER)
    args = _toy_args(_toy_data(tmp_path), tmp_path / algo, algo=algo, steps=40, prompts_per_step=32, group_size=8,
                     mini_batch_prompts=16, micro_batch_size=64, max_response_len=2, lr=3e-3, rollout_chunk=0,
                     export_hf=False)
    with _one_thread():
        assert train.main(args) == 0
    acc = [m["reward/acc"] for m in _metrics(tmp_path / algo)]
    assert sum(acc[:3]) / 3 < 0.15 and sum(acc[-5:]) / 5 > 0.3, acc


def test_train_torchrun_two_processes_match_one(tmp_path):
    """torchrun 2 processes (gloo, FSDP2) = 1 process without FSDP: same losses, same parameters after the update."""
    data = _toy_data(tmp_path)
    _run(tmp_path, _toy_args(data, tmp_path / "one"), nproc=1)
    _run(tmp_path, _toy_args(data, tmp_path / "two"), nproc=2)
    one, two = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    assert one["updates"] == 2
    for key in ("reward/mean", "response/len_mean", "loss/policy", "grad_norm", "entropy/mean", "clip/frac_high"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    # Adam's first steps are ~lr * sign(g): allow float-rounding-level gradient differences only through lr.
    _close(load_file(tmp_path / "one" / "hf" / "model.safetensors"),
           load_file(tmp_path / "two" / "hf" / "model.safetensors"), atol=1e-5)


def test_train_micro_batch_size_does_not_change_update(tmp_path, monkeypatch):
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "mb1", micro_batch_size=1)) == 0
        assert train.main(_toy_args(data, tmp_path / "mb4", micro_batch_size=4)) == 0
    one, four = _metrics(tmp_path / "mb1")[0], _metrics(tmp_path / "mb4")[0]
    assert one["updates"] == 2
    for key in ("loss/policy", "grad_norm", "clip/frac_high", "s2t/candidates"):
        assert one[key] == pytest.approx(four[key], rel=1e-4, abs=1e-6), key
    _close(load_file(tmp_path / "mb1" / "hf" / "model.safetensors"),
           load_file(tmp_path / "mb4" / "hf" / "model.safetensors"), atol=1e-5)


def test_train_resume_is_exact(tmp_path, monkeypatch):
    """Stop after 2 steps, resume: step 3 equals the uninterrupted run's step 3."""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", steps=3, export_hf=False)) == 0
        assert train.main(_toy_args(data, tmp_path / "cut", steps=2, save_every=2, export_hf=False)) == 0
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "3"]) == 0
    full, cut = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [0, 1, 2]
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[2].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[2].items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_hf_export_reproduces_logprobs(tmp_path, monkeypatch):
    _patch(monkeypatch, _EVEN)
    cfg = train.parse_config(_toy_args(_toy_data(tmp_path), tmp_path / "run", steps=1))
    rank, world, device = train.init_distributed()
    try:
        with _one_thread():
            state = train.setup(cfg, rank, world, device)
            train.train(cfg, rank, world, device, state)
    finally:
        dist.destroy_process_group()
    policy = state[0]
    exported = Policy(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")).eval()
    input_ids = torch.randint(4, _TOY_VOCAB, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    with torch.no_grad():
        expected = policy.eval()(input_ids, attention_mask, response_mask)[0]
        got = exported(input_ids, attention_mask, response_mask)[0]
    assert _metrics(tmp_path / "run")[0]["updates"] >= 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_train_bad_inputs_one_line_error(tmp_path, capsys):
    data = _toy_data(tmp_path)
    bad_row = tmp_path / "bad.jsonl"
    bad_row.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    cases = {
        "data file not found": _toy_args(str(tmp_path / "missing.jsonl"), tmp_path / "o"),
        "bad.jsonl row 1: no answer": _toy_args(str(bad_row), tmp_path / "o"),
        "unknown --algo 'ppo'": _toy_args(data, tmp_path / "o", algo="ppo"),
        "model directory not found": _toy_args(data, tmp_path / "o", model="./no/such/model"),
    }
    for expected, args in cases.items():
        assert train.main(args) == 2, expected
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and err[0].startswith("train.py: error:"), (expected, err)
    # the same from a shell: exit status 2, one line on stderr, no traceback
    proc = subprocess.run([sys.executable, "train.py"] + cases["data file not found"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [x for x in proc.stderr.splitlines() if "error" in x]


def test_train_skips_zero_advantage_and_nonfinite_steps(tmp_path, monkeypatch):
    """All-equal rewards skip every update; a NaN loss skips the update with a warning; the run finishes."""
    data = _toy_data(tmp_path)
    _patch(monkeypatch, _EVEN)
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "zero")) == 0
    zero = _metrics(tmp_path / "zero")[0]
    assert zero["skipped/zero_adv"] == 2 and zero["updates"] == 0 and zero["adv/zero_frac"] == 1.0

    _patch(monkeypatch, _EVEN)
    policy_loss = train.stapo.policy_loss
    monkeypatch.setattr(train.stapo, "policy_loss", lambda *a, **k: (policy_loss(*a, **k)[0] * float("nan"),
                                                                     policy_loss(*a, **k)[1]))
    with _one_thread(), pytest.warns(UserWarning, match="non-finite gradient norm"):
        assert train.main(_toy_args(data, tmp_path / "nan", steps=2)) == 0
    nan = _metrics(tmp_path / "nan")
    assert [m["skipped/nonfinite"] for m in nan] == [2, 2] and all(m["updates"] == 0 for m in nan)
    _close(load_file(tmp_path / "nan" / "hf" / "model.safetensors"), tiny_model(vocab_size=_TOY_VOCAB).state_dict(),
           atol=0)  # parameters untouched (no step, no weight decay)


@pytest.mark.parametrize("algo,flags", [("grpo", {"kl_beta": 0.04}), ("20-entropy", {}), ("fullmask", {}),
                                        ("stapo", {"dual_clip": 10.0, "grad_checkpointing": True})])
def test_train_every_algorithm_runs(tmp_path, monkeypatch, algo, flags):
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", algo=algo, export_hf=False, **flags)) == 0
    m = _metrics(tmp_path / "run")[0]
    assert m["updates"] == 2 and math.isfinite(m["loss/policy"])
    if algo == "20-entropy":  # keeps the top 20% entropies: about 80% of response tokens silenced
        assert 0.6 < m["s2t/silenced_frac"] < 0.9
    if algo == "grpo":
        assert m["loss/kl"] >= 0
