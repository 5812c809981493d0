"""conftest.py: the suite's own caches, removed when the process that made them exits.
"""
import os
import subprocess
import sys

from tests.toy_task import ROOT


# ==================================================================================================
# conftest.py: the suite's caches
# ==================================================================================================
def test_model_suite_cache_removed_when_its_process_exits():
    """The test suite's own GGUF cache (conftest.py) is removed when the process that made it exits,
    contents and all; a process that inherits STAPO_CACHE leaves it alone. (Each run of the suite
    left ~0.5 GB behind.)"""
    code = ("import os, conftest; c = os.environ['STAPO_CACHE']; "
            "open(os.path.join(c, 'x'), 'w').write('x'); print(c)")
    env = {k: v for k, v in os.environ.items() if k != "STAPO_CACHE"}
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, check=True)
    folder = made.stdout.strip().splitlines()[-1]
    assert os.path.basename(folder).startswith("stapo-test-cache-") and not os.path.exists(folder)
    inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               cwd=ROOT, check=True)
    assert inherited.stdout.strip().splitlines()[-1] == os.environ["STAPO_CACHE"]
    # it was there: the inheriting process left it alone
    os.remove(os.path.join(os.environ["STAPO_CACHE"], "x"))
