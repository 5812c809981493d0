"""`python -m tools.bench train-step`: the CPU default step (`train.py --preset cpu`) with each
rollout engine, plain and vllm, from the runs' metrics.jsonl (docs/rollouts.md)."""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.harness import ROOT

def bench_train_step(steps=4):
    """`train.py --preset cpu` for `steps` steps with each engine (subprocesses, one after the
    other); mean seconds per step after the first (engine warm-up), from metrics.jsonl."""
    rows = {}
    for engine in ("plain", "vllm"):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, str(ROOT / "train.py"), "--preset", "cpu", "--steps", str(steps),
                   "--rollout", engine, "--out-dir", out, "--no-export-hf", "--no-plots"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(f"{engine}: failed: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            lines = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()][1:]
            rows[engine] = [statistics.mean(m[k] for m in lines)
                            for k in ("time/rollout_s", "time/update_s")] + [
                statistics.mean(m["rollout/logprob_diff"] for m in lines)]
    print(f"\n`train.py --preset cpu`, mean of steps 2..{steps}\n")
    print("| engine | rollout + pi_old s | update s | step s | step vs plain | "
          "rollout/logprob_diff |")
    print("|---|---|---|---|---|---|")
    for engine, (roll, upd, diff) in rows.items():
        ratio = (roll + upd) / sum(rows["plain"][:2]) if "plain" in rows else float("nan")
        print(f"| {engine} | {roll:.2f} | {upd:.2f} | {roll + upd:.2f} | {ratio:.2f}x | "
              f"{diff:.1e} |")
