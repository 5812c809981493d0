"""Shared by test_stapo.py and tests/: helpers used by more than one test file, the `_hook_*` functions
testdata/train_run.py calls by name, and the suite's settings (its own GGUF cache). Test files import what they use:
`from conftest import NAME`.
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# GGUF files converted by model.py and torch.compile's kernels (the vLLM tests) are cached; the suite keeps its own
# caches (subprocesses inherit them), removed when the process that made them exits (each run of the suite left
# ~0.5 GB of GGUF conversions in the temporary directory, and its kernels beside torch's precompiled header, which
# torch keeps in TMPDIR/torchinductor_USER whatever the variable says). Set before torch loads: importing it sets
# TORCHINDUCTOR_CACHE_DIR to that folder.
for _variable, _prefix in (("STAPO_CACHE", "stapo-test-cache-"), ("TORCHINDUCTOR_CACHE_DIR", "stapo-test-inductor-")):
    if _variable not in os.environ:
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)

import pytest  # noqa: E402 - after the caches' variables
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import reward  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from model import position_ids_from_mask, tiny_model, tiny_tokenizer  # noqa: E402
from rollout import Rollout, format_prompt  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """The machine's load is other work's, not a test's: train.py's busy-machine warning sees an idle machine, so
    tests that read stderr line by line do not depend on it (test_busy_machine_is_named_with_its_fix sets a load)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


# ==================================================================================================================
# rollout.py: the KV-cache sampler
# ==================================================================================================================
_PROBLEMS = ["1+1", "What is 12*13?", "x", "abc def"]
_REAL_VOCAB = 104  # len(tiny_tokenizer()); the tiny model has 128 embedding rows


def _prompts() -> list[list[int]]:
    tok = tiny_tokenizer()
    return [format_prompt(tok, p) for p in _PROBLEMS]


def _recomputed_logprobs(lm, rollout: Rollout, temperature: float, vocab_size: int | None) -> torch.Tensor:
    """log pi(y_t) of every response token from one teacher-forced forward over prompt + response. (B, T)"""
    input_ids, attention_mask = rollout.training_inputs()  # (B, P+T)
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    P = rollout.prompt_ids.shape[1]
    logits = logits[:, P - 1:-1, :vocab_size].float() / temperature  # (B, T, V') position P+t-1 predicts token t
    return torch.log_softmax(logits, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)  # (B, T)


def _two_processes(worker, tmp: str, hung: str, timeout_s: float = 120) -> None:
    """worker(rank, init_file, tmp) on 2 spawned processes (file:// rendezvous in tmp); both are killed and the test
    fails with `hung` if they have not finished within timeout_s."""
    ctx = mp.start_processes(worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError(hung)


# ==================================================================================================================
# reward.py: answer extraction and grading
# ==================================================================================================================
TESTDATA = Path(__file__).parent / "testdata"


def _reward_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ==================================================================================================================
# train.py: the training loop end to end
# ==================================================================================================================
ROOT = Path(__file__).parent
# The toy task: "ab" -> the digit a+b (sums <= 9). The tiny model gets a 14-row vocabulary: the 4 special tokens
# and the 10 digits (ids 0..13 of the tiny tokenizer), so a random model is right about 7% of the time.
_TOY_VOCAB = 14
# The reward (testdata/train_run.py's TOY_REWARD): the first emitted character is the answer digit, or an even
# digit (~1/2 right: groups of mixed rewards, for the equality tests).
_ANSWER, _EVEN = "answer", "even"
_CHECKS = {_ANSWER: lambda response, gold: response.strip()[:1] == gold,
           _EVEN: lambda response, gold: response.strip()[:1] in ("0", "2", "4", "6", "8")}


def _toy_data(tmp_path: Path) -> str:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


def _toy_args(data: str, out: Path, **flags) -> list[str]:
    base = dict(model="tiny", data=data, answer_key="answer", instruction="", algo="stapo", steps=1,
                prompts_per_step=4, group_size=4, mini_batch_prompts=2, max_tokens_per_micro_batch=20,
                max_response_len=3, lr=1e-3, warmup_steps=0, rollout_chunk=1, save_every=0, out_dir=str(out),
                preset="cpu", plots=False, heldout=0)  # no held-out set unless asked (the default holds out a tenth)
    base.update(flags)
    args = ["--no-chat"]
    for key, value in base.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return args


def _patch(monkeypatch, check: str = _ANSWER) -> None:
    """The toy task in this process (testdata/train_run.py sets it up in another)."""
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0 if _CHECKS[check](response, gold)
                        else -1.0)
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


def _run(tmp_path: Path, args: list[str], nproc: int = 1, check: str = _EVEN, head_dim: int = 16,
         hook: tuple | None = None, expect: int | None = 0) -> subprocess.CompletedProcess:
    """train.py with `args` on the toy task (or check="real": none) in a fresh process, testdata/train_run.py
    (torchrun for nproc > 1), after the test hook (name, *args) of this file; its exit status must be `expect`
    (None: any)."""
    runner = [str(ROOT / "testdata" / "train_run.py")]
    cmd = [sys.executable, *runner] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *runner]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": check, "TOY_HEAD_DIM": str(head_dim),
           "TOY_HOOK": json.dumps([hook[0], list(hook[1:])]) if hook else ""}
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert expect is None or proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def _varied_data(tmp_path: Path) -> str:
    """Toy prompts of 2-6 digits, so that rollouts left-pad them and rows differ in prompt and response length."""
    path = tmp_path / "varied.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}" + "0" * ((a + b) % 5), "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


_EVERY_ALGO = [("stapo", {}), ("justrl", {}), ("grpo", {"kl_beta": 0.04}), ("20-entropy", {}), ("fullmask", {})]
_BUDGET_KEYS = ("loss/policy", "loss/kl", "grad_norm", "s2t/candidates", "s2t/silenced", "clip/frac_high",
                "ratio/mean", "kl/approx", "entropy/mean")


def _budget_args(data, out, algo, flags, budget):
    # tau_p 0.2: the random model's probabilities are ~1/14, so S2T and FullMask find candidates to silence.
    # lr 1e-4: Adam's first steps are ~lr * sign(g), so a rounding-level gradient difference of a parameter whose
    # gradient is ~0 can move it by up to lr; atol 1e-5 is then a tenth of a step.
    return _toy_args(data, out, algo=algo, max_response_len=8, tau_p=0.2, lr=1e-4,
                     max_tokens_per_micro_batch=budget, **flags)


def _same_update(a: Path, b: Path) -> None:
    ma, mb = _metrics(a)[0], _metrics(b)[0]
    assert ma["updates"] == 2
    for key in _BUDGET_KEYS:
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
    _close(load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors"), atol=1e-5)


def _hook_count_micro_batches(log: str) -> None:
    """(testdata/train_run.py) Every rank appends (its own micro-batch count, the agreed count) of each split to
    LOG/rank<R>."""
    all_max = train.all_max

    def logged_max(value):
        agreed = all_max(value)
        with open(os.path.join(log, "rank" + os.environ.get("RANK", "0")), "a") as f:
            f.write(f"{value} {agreed}\n")
        return agreed
    train.all_max = logged_max


def _counts(log: Path, rank: int) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in (log / f"rank{rank}").read_text().splitlines()]


def _md5s(folder: Path) -> dict[str, str]:
    """{relative path: md5} of every file under folder but run.lock (it names the last process that opened it)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def _one_line_error(capsys, expected: str) -> None:
    """stderr holds one error line (beside progress bars and warnings), with `expected` in it, and no traceback."""
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("train.py: error:")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, (expected, err[-2000:])


def _hook_kill_in_the_second_checkpoint() -> None:
    """(testdata/train_run.py) The process dies (exit 9) between the second checkpoint's files and `latest`."""
    replace_file, named = os.replace, []

    def dies_before_latest(src, dst):
        if str(dst).endswith("latest"):
            named.append(dst)
            if len(named) == 2:
                os._exit(9)
        return replace_file(src, dst)
    os.replace = dies_before_latest


# ==================================================================================================================
# run_folder.py: runs that survive a cluster (stop signals, --resume auto, world sizes, one writer, logs,
# verified checkpoints, exports)
# ==================================================================================================================
def _hook_signal_at(owner: str, name: str, nth: int, rank: str = "0", sig: str = "SIGTERM", times: int = 1,
                    parent: bool = False) -> None:
    """(testdata/train_run.py) A stop signal from inside the run at a chosen call (deterministic: no timing):
    `sig` `times` times to this process (or, `parent`, to the one that started it: torchrun) at the nth call of
    OWNER.NAME (owner: "train" or "rollout.PlainEngine"), on rank `rank`."""
    import signal

    module, _, cls = owner.partition(".")
    target = getattr(sys.modules[module], cls) if cls else sys.modules[module]
    original, calls = getattr(target, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth and os.environ.get("RANK", "0") == rank:
            for _ in range(times):
                os.kill(os.getppid() if parent else os.getpid(), getattr(signal, sig))
        return original(*args, **kwargs)
    setattr(target, name, wrapped)


def _hook_signal_then_hang(nth: int) -> None:
    """(testdata/train_run.py) SIGTERM at the nth rollout, and then the rollout never returns, as a rank waits in a
    collective for a frozen one (SIGSTOP, a dead network)."""
    import signal

    sample, calls = rollout.PlainEngine.sample, []

    def hangs(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait()
        return sample(*args, **kwargs)
    rollout.PlainEngine.sample = hangs


def _hook_data_unreadable_on_rank_1() -> None:
    """(testdata/train_run.py) Rank 1 cannot read the data (a file one node does not see)."""
    load_rows = train.load_rows

    def unreadable(cfg):
        if os.environ.get("RANK") == "1":
            raise ValueError("toy.jsonl line 3: unreadable here")
        return load_rows(cfg)
    train.load_rows = unreadable
