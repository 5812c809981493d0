"""The toy task the training tests share: a tiny random model whose 14-row vocabulary is the digits,
toy data, the flags of a small run, the reward patched to a rule (`patch_toy_task`), a run in a
fresh process (`run_train`, testdata/train_run.py), and what the tests read back (metrics,
checksums, one-line errors)."""
import errno
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import config
import reward
import run_folder
from config import read_inputs
from model import tiny_model, tiny_tokenizer
from startup.run import setup

# ==================================================================================================
# reward.py: answer extraction and grading
# ==================================================================================================


def reward_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ==================================================================================================
# train.py: the training loop end to end
# ==================================================================================================
ROOT = Path(__file__).resolve().parent.parent  # the repository
TESTDATA = ROOT / "testdata"


# The toy task: "ab" -> the digit a+b (sums <= 9). The tiny model gets a 14-row vocabulary: the 4
# special tokens and the 10 digits (ids 0..13 of the tiny tokenizer), so a random model is right
# about 7% of the time.
TOY_VOCAB = 14


# The reward (testdata/train_run.py's TOY_REWARD): the first emitted character is the answer digit,
# or an even digit (~1/2 right: groups of mixed rewards, for the equality tests).
ANSWER = "answer"


EVEN = "even"


CHECKS = {ANSWER: lambda response, gold: response.strip()[:1] == gold,
           EVEN: lambda response, gold: response.strip()[:1] in ("0", "2", "4", "6", "8")}


def toy_data(tmp_path: Path) -> str:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


def toy_args(data: str, out: Path, **flags) -> list[str]:
    base = dict(model="tiny", data=data, answer_key="answer", instruction="", algo="stapo", steps=1,
                prompts_per_step=4, group_size=4, mini_batch_prompts=2,
                max_tokens_per_micro_batch=20, max_response_len=3, lr=1e-3, warmup_steps=0,
                rollout_chunk=1, save_every=0, out_dir=str(out), preset="cpu", plots=False,
                heldout=0)  # no held-out set unless asked (the default holds out a tenth)
    base.update(flags)
    args = ["--no-chat"]
    for key, value in base.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False \
            else [flag, str(value)]
    return args


def patch_toy_task(monkeypatch, check: str = ANSWER) -> None:
    """The toy task in this process (testdata/train_run.py sets it up in another)."""
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo":
                        1.0 if CHECKS[check](response, gold) else -1.0)
    monkeypatch.setattr("startup.run.lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    monkeypatch.setattr("startup.run.load_model",
                        lambda name, **kw: (tiny_model(vocab_size=TOY_VOCAB), tiny_tokenizer()))


@contextmanager
def one_thread():
    """One intra-op thread while training the tiny model: its tiny ops are ~20x faster on a busy
    machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run_train(tmp_path: Path, args: list[str], nproc: int = 1, check: str = EVEN,
              head_dim: int = 16, hook: tuple | None = None, expect: int | None = 0,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """train.py with `args` on the toy task (or check="real": none) in a fresh process,
    testdata/train_run.py (torchrun for nproc > 1), after the test hook (name, *args) of
    tests/run_hooks.py; its exit status must be `expect` (None: any), within `timeout` seconds."""
    runner = [str(ROOT / "testdata" / "train_run.py")]
    cmd = [sys.executable, *runner] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        *runner]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": check, "TOY_HEAD_DIM": str(head_dim),
           "TOY_HOOK": json.dumps([hook[0], list(hook[1:])]) if hook else ""}
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert expect is None or proc.returncode == expect, proc.stderr[-3000:]
    return proc


def tensors_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def varied_data(tmp_path: Path) -> str:
    """Toy prompts of 2-6 digits, so that rollouts left-pad them and rows differ in prompt and
    response length."""
    path = tmp_path / "varied.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}" + "0" * ((a + b) % 5),
                                        "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


EVERY_ALGO = [("stapo", {}), ("justrl", {}), ("grpo", {"kl_beta": 0.04}), ("20-entropy", {}),
              ("fullmask", {})]


BUDGET_KEYS = ("loss/policy", "loss/kl", "grad_norm", "s2t/candidates", "s2t/silenced",
               "clip/frac_high", "ratio/mean", "kl/approx", "entropy/mean")


def budget_args(data, out, algo, flags, budget):
    # tau_p 0.2: the random model's probabilities are ~1/14, so S2T and FullMask find candidates to
    # silence.
    # lr 1e-4: Adam's first steps are ~lr * sign(g), so a rounding-level gradient difference of a
    # parameter whose gradient is ~0 can move it by up to lr; atol 1e-5 is then a tenth of a step.
    return toy_args(data, out, algo=algo, max_response_len=8, tau_p=0.2, lr=1e-4,
                     max_tokens_per_micro_batch=budget, **flags)


def same_update(a: Path, b: Path) -> None:
    ma, mb = read_metrics(a)[0], read_metrics(b)[0]
    assert ma["updates"] == 2
    for key in BUDGET_KEYS:
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
    tensors_close(load_file(a / "hf" / "model.safetensors"),
                  load_file(b / "hf" / "model.safetensors"), atol=1e-5)


def read_counts(log: Path, rank: int) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split()))
            for line in (log / f"rank{rank}").read_text().splitlines()]


def md5s(folder: Path) -> dict[str, str]:
    """{relative path: md5} of every file under folder but run.lock (it names the last process that
    opened it)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "run.lock"}


def one_line_error(capsys, expected: str) -> None:
    """stderr holds one error line (beside progress bars and warnings), with `expected` in it, and
    no traceback."""
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("train.py: error:")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, \
        (expected, err[-2000:])


def toy_run(tmp_path, monkeypatch, **flags):
    """A Run of the toy task in this process (a 1-process group must exist), as train.main builds
    it: tau_p 0.2, so the random model's tokens are candidates."""
    patch_toy_task(monkeypatch, EVEN)
    cfg, _, _ = config.parse_config(budget_args(varied_data(tmp_path), tmp_path / "run",
                                                flags.pop("algo", "stapo"), flags, 40))
    return setup(cfg, read_inputs(cfg, 1), 0, 1, torch.device("cpu"), None, run_folder.Preemption())


def full_disk(real_open, names: tuple[str, ...] | None = None, when=lambda: True):
    """An `open` for a module's namespace (monkeypatch) on a full disk: while when() holds, a file
    opened for writing whose name is one of `names` (None: any), or its temporary file
    (NAME.tmp-PID, run_folder.write_atomic's), raises OSError ENOSPC naming it; no root needed."""
    def opened(path, mode="r", *args, **kwargs):
        name = Path(path).name
        if when() and any(c in mode for c in "wax+") and (names is None or any(
                name == n or name.startswith(n + ".tmp-") for n in names)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)
    return opened
