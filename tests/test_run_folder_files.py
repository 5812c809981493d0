"""run_folder/files.py: the code that ran (config.json's "code"), against git itself in a
repository made here."""
import shutil
import subprocess

import pytest

from run_folder import code_version

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_code_version_names_the_commit_and_whether_the_tree_changed(tmp_path):
    """A clean checkout: its HEAD and dirty false; an edited tracked file or a staged new one: dirty
    true; an untracked file (a log beside the code: a fresh clone's `make run > run.log` read
    dirty) or an ignored one: clean; an untracked .py file (a new module a run imports, even in a
    new folder): dirty; a folder inside another repository (a copy of the code in a user's project)
    or outside any: null, null."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "train.py").write_text("print(1)\n")
    (root / ".gitignore").write_text("out/\n")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git(root, "rev-parse", "HEAD")
    assert code_version(root) == {"commit": head, "dirty": False}
    (root / "out").mkdir()
    (root / "out" / "config.json").write_text("{}")
    assert code_version(root) == {"commit": head, "dirty": False}
    (root / "train.py").write_text("print(2)\n")
    assert code_version(root) == {"commit": head, "dirty": True}
    git(root, "checkout", "-q", "train.py")
    (root / "run.log").write_text("")
    assert code_version(root) == {"commit": head, "dirty": False}
    (root / "tasks").mkdir()
    (root / "tasks" / "mine.py").write_text("")
    assert code_version(root) == {"commit": head, "dirty": True}
    (root / "tasks" / "mine.py").unlink()
    git(root, "add", "run.log")
    assert code_version(root) == {"commit": head, "dirty": True}
    (root / "sub").mkdir()
    assert code_version(root / "sub") == {"commit": None, "dirty": None}
    assert code_version(tmp_path / "plain") == {"commit": None, "dirty": None}
