"""Run folders written by hand for the reports' tests (tests/test_reports_*.py): a run's
config.json, metrics.jsonl and eval.jsonl (`fake_run`), and tokens.jsonl lines whose gradient norm
falls or rises with p (`token_records`)."""
import json
from pathlib import Path

import torch


def token_records(n: int = 400, seed: int = 0, sign: float = -1.0) -> list[dict]:
    """tokens.jsonl lines whose gradient norm falls (sign -1) or rises (+1) with log p, and does not
    depend on H."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.rand(n, generator=g) * -6  # p from 1e-6 to 1
    H = torch.rand(n, generator=g) * 3
    # monotone in p, noise
    norm = (1 + sign * logp / 6).clamp(min=0.01) + 0.05 * torch.rand(n, generator=g)
    half = n // 2
    return [{"step": 1, "mini_batch": k, "tau_h": None, "p": (10 ** logp[s]).tolist(),
             "H": H[s].tolist(), "A": [1.0] * half, "grad_norm": norm[s].tolist(),
             "weight": [1.0] * half, "correct": [k % 2] * half, "candidate": [0] * half,
             "silenced": [0] * half}
            for k, s in enumerate((slice(0, half), slice(half, n)))]


def fake_run(path: Path, rewards: list[float], acc: list[float], algo: str = "stapo") -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"algo": algo, "tau_p": 0.002}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": r,
                                                            "entropy/mean": 1.0 - i / 10,
                                                            "s2t/silenced_frac": 1e-3}) + "\n"
                                                for i, r in enumerate(rewards)))
    (path / "eval.jsonl").write_text("".join(json.dumps({"step": 2 * i, "eval/acc": a}) + "\n"
                                             for i, a in enumerate(acc)))
    return str(path)
