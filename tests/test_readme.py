"""README.md: its install line, and its CPU commands run in order."""
import os
import subprocess
import sys

import eval as ev
import model
from tests.toy_task import EVEN, ROOT, one_thread, read_metrics


def test_readme_install_gives_cpu_linux_the_cpu_torch_build():
    """PyPI's torch==2.13.0 for Linux is the CUDA build (gigabytes of nvidia-* and triton packages):
    the quick start installs the CPU build from PyTorch's CPU wheel index before requirements.txt,
    and requirements.txt's comment no longer says `pip install -r requirements.txt` takes the CPU
    build."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Quick start"):readme.index("## GPUs and many nodes")]
    cpu_line = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_line in block and \
        block.index(cpu_line) < block.index("pip install -r requirements.txt")
    requirements = (ROOT / "requirements.txt").read_text()
    assert cpu_line in requirements and "takes the CPU build" not in requirements
    assert "torch==2.13.0\n" in requirements  # the CPU build 2.13.0+cpu meets the pin: pip keeps it


def _readme_cpu_commands() -> list[str]:
    """The train.py, torchrun and eval.py lines of the README's first two bash blocks (the quick
    start and what follows it on a CPU), in order, comments cut."""
    blocks = (ROOT / "README.md").read_text().split("```bash\n")[1:3]
    lines = [line.split("  #")[0].strip() for block in blocks
             for line in block.split("```")[0].splitlines()]
    return [line for line in lines
            if line.startswith(("python train.py", "python eval.py", "torchrun"))]


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
