"""The suite's settings, loaded by pytest before any test file: its own GGUF and kernel caches,
removed when the process that made them exits, and an idle machine's load for every test. The
helpers several test files share are modules named for them in tests/ (toy_task.py,
sampler_checks.py, model_batches.py, s2t_threshold.py, run_hooks.py), never names in this file.
"""
import atexit
import os
import shutil
import tempfile

import pytest

# GGUF conversions (model_files/gguf.py) and torch.compile's kernels (vLLM tests) are cached; the
# suite keeps its own caches (subprocesses inherit them), removed when the process that made them
# exits (each suite run left ~0.5 GB of GGUF conversions in the temp directory, and its kernels
# beside torch's precompiled header, which torch keeps in TMPDIR/torchinductor_USER whatever the
# variable says). Set before torch loads: importing it sets TORCHINDUCTOR_CACHE_DIR to that folder.
for _variable, _prefix in (("STAPO_CACHE", "stapo-test-cache-"),
                           ("TORCHINDUCTOR_CACHE_DIR", "stapo-test-inductor-")):
    if _variable not in os.environ:
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The machine's load is other work's, not a test's: the busy-machine warning sees an idle
    machine (no CPU time counters: the load average, 0), so tests that read stderr line by line do
    not depend on it (the warning's own tests set a load)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr("step_metrics.step_warnings.PROC_STAT", os.devnull + ".none")
