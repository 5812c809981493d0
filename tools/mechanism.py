"""Does a spurious token's update hurt? The mechanism of docs/paper.md §4 measured update by update
(docs/experiments.md, "The mechanism experiment").

    python -m tools.mechanism --out-dir DIR [--checkpoint CKPT] [options] -- TRAIN.PY FLAGS
    python -m tools.mechanism --report DIR [DIR ...] [--sesoi X]

From one policy state (the flags' model, or a train.py checkpoint with its AdamW state), rollouts of
the training prompts are scanned for mini-batches in which S2T's rule silences a token of the graded
part of a response. Each such mini-batch is updated three times from the same state, by JustRL,
STAPO and RandMask (the same rows, pi_old, advantages, optimizer state and lr; only the token
weights differ), and each update is measured on held-out prompts it never saw: (a) the
teacher-forced log-likelihood of correct worked solutions, (b) the entropy on fixed held-out
responses (the state's own samples), (c) the accuracy of samples drawn with the same seeds for
every policy, and (d) the inner product of the silenced tokens' gradient (JustRL's N) with the
held-out likelihood's. One line per mini-batch in DIR/mechanism.jsonl (--resume auto continues);
--report computes the plan's statistics (tools/confirm.py's paired t, Wilcoxon and Holm).
"""
from __future__ import annotations

import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Literal, NamedTuple

from startup import early  # noqa: F401 - first: MKL's reproducible sums, before torch loads
import numpy as np
import torch
from tqdm import tqdm

from command_line import errors, flags
import config
import reward
import rollout
import run_folder
import stapo
import train
from data import problem_seed
from step_metrics.step_log import graded_tokens
from tasks.chain_sums import worked
from tools.confirm import chi2_quantile, holm, paired_t, wilcoxon

PROG = "tools.mechanism"
ARMS = ("justrl", "stapo", "randmask")
FILE = "mechanism.jsonl"
OUTCOMES = ("ll", "entropy", "acc")  # what `measure` measures (its other keys: seconds)
SESOI = 2e-4  # nats per token: the plan's smallest effect of interest (docs/experiments.md)
SCREEN_MARGIN = 0.1  # nats: a rollout without a token near log tau_p needs no pi_old pass


@dataclass
class Options:
    """Measure what one update of JustRL, STAPO and RandMask does to held-out prompts, from one
    policy state: python -m tools.mechanism --out-dir DIR [flags] -- TRAIN.PY FLAGS."""
    out_dir: str = ""
    """the folder of mechanism.jsonl (one line per measured mini-batch)"""
    checkpoint: str = ""
    """a train.py checkpoint folder (RUN/checkpoint/step_N): its model, AdamW and schedule are the
    state; '' = the flags' model with a fresh AdamW"""
    state: str = ""
    """the state's name in the lines and the report (default: the checkpoint's, else 'initial')"""
    mini_batches: int = 30
    """measure until this many mini-batches (in which S2T silences a graded token) are done"""
    first_step: int = 1
    """the first rollout step scanned (train.py's step numbers: its prompts and seeds)"""
    max_steps: int = 2000
    """scan up to this step"""
    heldout_prompts: int = 0
    """held-out problems whose worked solutions (a) are scored (0 = all of the flags' --heldout)"""
    acc_prompts: int = 64
    """the first held-out problems of the entropy (b) and the accuracy (c) (0 = all)"""
    acc_samples: int = 4
    """samples per held-out problem for the accuracy (the same seeds for every policy)"""
    prompts_per_call: int = 16
    """held-out problems per generate call of the accuracy"""
    solutions: Literal["worked", "answer"] = "worked"
    """'worked' (tasks/chain_sums.py's and the blank line) or 'answer' (the gold answer alone)"""
    resume: Literal["", "auto"] = ""
    """'auto': continue DIR/mechanism.jsonl where it stopped (the same state and flags)"""


class HeldOut(NamedTuple):
    """What every policy of a state is measured on."""
    solutions: rollout.Rollout  # the worked solutions, teacher-forced (a shared prompt prefix)
    solution_target: torch.Tensor  # (B, T) bool: the solution's tokens in the response columns
    responses: rollout.Rollout  # the state's own first sample of each problem
    response_target: torch.Tensor  # (B, T) bool
    prompts: list[list[int]]  # the held-out prompts of (b) and (c)
    rows: list[dict]  # their rows


# ------------------------------------------------------------------------------ held-out measures
def worked_solution(row: dict, kind: str) -> str:
    """The correct response to a held-out row: tasks/chain_sums.py's worked format after "A:" and
    the blank line that ends a response (--stop-text), or the gold answer alone."""
    if kind == "answer":
        return str(row["answer"])
    question = row["problem"].rstrip().rsplit("Q:", 1)[-1]
    terms = question.split("=")[0].split("+")
    if not question.endswith("A:") or not all(t.strip().isdigit() for t in terms):
        raise ValueError(f"held-out problem {row['problem'][-40:]!r} is not a chained sum "
                         "(tasks/chain_sums.py); use --solutions answer")
    return f" {worked(tuple(int(t) for t in terms))}\n\n"


def teacher_forced(prompts: list[list[int]], targets: list[list[int]],
                   pad: int) -> tuple[rollout.Rollout, torch.Tensor]:
    """(a Rollout of each prompt followed by its target, bool (B, T) of the target's columns). The
    prompts' common first tokens are the Rollout's prompt (model.Policy runs a shared prompt once);
    the rest of each prompt leads its response."""
    common = 0
    while all(len(p) > common + 1 and p[common] == prompts[0][common] for p in prompts):
        common += 1
    cut = [common or len(p) for p in prompts]
    prompt_ids, prompt_mask = rollout.left_pad([p[:c] for p, c in zip(prompts, cut)], pad)
    rest = [p[c:] + t for p, c, t in zip(prompts, cut, targets)]
    T = max(map(len, rest))
    ids = torch.full((len(rest), T), pad, dtype=torch.long)
    mask, target = torch.zeros(len(rest), T, dtype=torch.long), torch.zeros(len(rest), T).bool()
    for i, (r, p, c) in enumerate(zip(rest, prompts, cut)):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        target[i, len(p) - c:len(r)] = True
    return rollout.Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(ids.shape),
                           torch.zeros(len(rest), dtype=torch.bool)), target


def accuracy(run, held: HeldOut, samples: int, per_call: int) -> tuple[float, rollout.Rollout]:
    """(held-out accuracy of `samples` samples per problem, the samples): generate calls of
    `per_call` problems, each seeded by its first problem, the same for every policy (common random
    numbers)."""
    cfg = run.cfg
    seeds = [problem_seed(cfg.seed + 2, i) for i in range(0, len(held.prompts), per_call)]
    run.policy.eval()
    with run.engine.ready(run.policy):
        out = run.engine.sample(held.prompts, samples, seeds, per_call, cfg.max_response_len,
                                cfg.temperature, cfg.top_p)
    texts = out.texts(run.tokenizer)
    rows = [held.rows[j // samples] for j in range(len(texts))]
    rewards = reward.rewards(texts, [r["answer"] for r in rows], cfg.reward, rows)
    return float(np.mean([r > 0 for r in rewards])), out


def measure(run, held: HeldOut, opts: Options) -> dict:
    """The policy's (a) mean log-likelihood per token of the worked solutions, (b) mean entropy per
    token of the fixed responses, (c) accuracy, (nats, nats, share)."""
    cfg = replace(run.cfg, max_tokens_per_micro_batch=max(run.cfg.max_tokens_per_micro_batch, 8192))
    run.policy.eval()
    t0 = time.time()
    a = train.token_stats(run.policy, held.solutions, cfg, run.device)
    b = train.token_stats(run.policy, held.responses, cfg, run.device)
    t1 = time.time()
    acc, _ = accuracy(run, held, opts.acc_samples, opts.prompts_per_call)
    return {"ll": float(a.logprobs[held.solution_target].double().mean()),
            "entropy": float(b.entropy[held.response_target].double().mean()), "acc": acc,
            "forward_s": t1 - t0, "sample_s": time.time() - t1}


def likelihood_gradient(run, held: HeldOut) -> list[torch.Tensor]:
    """The gradient of (a), the mean log-likelihood per token of the worked solutions, one tensor
    per parameter (the first-order outcome's second factor)."""
    run.optimizer.zero_grad(set_to_none=True)
    run.policy.train()
    n = held.solution_target.sum()
    for rows in held.solutions.micro_batches(run.cfg.max_tokens_per_micro_batch):
        stats = train.policy_forward(run.policy, held.solutions.select(rows), run.cfg, run.device)
        target = held.solution_target[rows][:, :stats.logprobs.shape[1]].to(run.device)
        ((stats.logprobs * target).sum() / n).backward()
    grads = [torch.zeros(p.numel()) if p.grad is None else p.grad.detach().reshape(-1).clone()
             for p in run.policy.parameters()]
    run.optimizer.zero_grad(set_to_none=True)
    return grads


def release_freed_memory() -> None:
    """Undo setup's memory.allocator.keep_freed_memory and give freed memory back: a process at its
    resident peak was killed for memory on a shared machine (glibc's defaults, then malloc_trim)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-4, 65536), libc.mallopt(-1, 128 * 1024), libc.malloc_trim(0)


# ----------------------------------------------------------------------------- one mini-batch
class State:
    """A Run at the state, put back before each update (the policy, AdamW's moments in place, lr and
    schedule), and (a)'s gradient there: kept in DIR/state.pt and mapped into memory (the page cache
    holds them, not the process: two processes of 5 GB were killed for memory)."""

    def __init__(self, run, path: Path, grad_ll: list[torch.Tensor]):
        self.run, self.path = run, path
        torch.save({"policy": run.policy.state_dict(), "optimizer": run.optimizer.state_dict(),
                    "grad_ll": grad_ll}, path)
        saved = torch.load(path, mmap=True, weights_only=True)
        self.policy, self.optimizer, self.grad_ll = saved.values()
        self.scheduler = copy.deepcopy(run.scheduler.state_dict())
        self.names = [name for name, _ in run.policy.named_parameters()]

    def restore(self) -> None:
        opt, saved = self.run.optimizer, self.optimizer
        self.run.policy.load_state_dict(self.policy)
        if not saved["state"]:  # a fresh AdamW
            opt.state.clear()
        for i, p in enumerate(q for group in opt.param_groups for q in group["params"]):
            for key, value in saved["state"].get(i, {}).items():
                state = opt.state[p]
                state[key] = state[key].copy_(value) if key in state else value.clone()
        for group, kept in zip(opt.param_groups, saved["param_groups"]):
            group["lr"] = kept["lr"]  # the schedule's
        self.run.scheduler.load_state_dict(copy.deepcopy(self.scheduler))

    def moved(self, direction: list[torch.Tensor]) -> float:
        """<theta - theta_state, direction>: the first-order change along `direction`."""
        return float(sum(torch.dot((p.detach() - self.policy[n]).reshape(-1), d).double()
                         for n, p, d in zip(self.names, self.run.policy.parameters(), direction)))


def measure_mini_batch(run, state: State, held: HeldOut, mb, graded: torch.Tensor,
                       opts: Options) -> dict:
    """One update of each arm from the state on mini-batch `mb` (train.MiniBatch; its p, H are the
    state's: pi_old), each measured (`measure`); the first-order inner product of the silenced
    tokens' gradient with (a)'s; the tokens STAPO silences."""
    cfg, pi, grad_ll = run.cfg, mb.pi_old, state.grad_ll
    arms, weights = {}, {}
    for arm in ARMS:
        state.restore()
        w = weights[arm] = stapo.token_weights(arm, pi.logprobs, pi.entropy, mb.advantages,
                                               mb.mask, cfg.tau_p, cfg.quantile, mb.context)
        run.optimizer.zero_grad(set_to_none=True)
        run.policy.train()
        lr, t0 = run.optimizer.param_groups[0]["lr"], time.time()
        update = train.accumulate_gradients(run, mb, w.weights, float(w.share))
        norm = train.optimizer_step(run) if update else None
        arms[arm] = {"N": float(w.share), "silenced": int(w.silenced.sum()), "lr": lr,
                     "grad_norm": norm, "predicted": state.moved(grad_ll),
                     "update_s": time.time() - t0, **measure(run, held, opts)}
    # (d): the objective's terms at the tokens STAPO silences, with JustRL's N (the gradient of J)
    state.restore()
    silenced = weights["stapo"].silenced
    run.optimizer.zero_grad(set_to_none=True)
    run.policy.train()
    train.accumulate_gradients(run, mb, silenced.float(), float(weights["justrl"].share))
    params = [(p.grad.reshape(-1), d) for p, d in zip(run.policy.parameters(), grad_ll)
              if p.grad is not None]  # the loss is -J
    inner = -float(sum(torch.dot(g, d).double() for g, d in params))
    norm_s = math.sqrt(sum(float(g.double().square().sum()) for g, _ in params))
    run.optimizer.zero_grad(set_to_none=True)
    norm_ll = math.sqrt(sum(float(d.double().square().sum()) for d in grad_ll))
    state.restore()
    ids = mb.rollout.response_ids
    tokens = [{"row": r, "t": t, "token": run.tokenizer.decode([int(ids[r, t])]),
               "p": math.exp(float(pi.logprobs[r, t])), "H": float(pi.entropy[r, t]),
               "A": float(mb.advantages[r, t]), "graded": bool(graded[r, t])}
              for r, t in silenced.nonzero().tolist()]
    mask = mb.mask.bool()
    return {"responses": len(mb.rollout), "tokens": int(mask.sum()),
            "graded_tokens": int((graded & mask).sum()), "correct": int(mb.correct.sum()),
            "candidates": int((mask & (mb.advantages > 0) &
                               (pi.logprobs < math.log(cfg.tau_p))).sum()),
            "silenced": int(silenced.sum()), "silenced_graded": int((silenced & graded).sum()),
            "tau_h": weights["stapo"].threshold,
            "randmask_same": bool(torch.equal(weights["randmask"].silenced, silenced)),
            "silenced_tokens": tokens, "arms": arms,
            "first_order": {"dot": inner, "cos": inner / (norm_s * norm_ll) if norm_s else 0.0,
                            "norm_silenced": norm_s, "norm_ll": norm_ll}}


# --------------------------------------------------------------------------------------- the scan
def read_lines(out: Path) -> list[dict]:
    """DIR/mechanism.jsonl's whole lines (one torn by a stop dropped, the file rewritten)."""
    torn: list[int] = []
    lines = run_folder.read_log(out / FILE, torn)
    if torn:
        run_folder.write_atomic(out / FILE, "".join(json.dumps(x) + "\n" for x in lines).encode())
    return lines


def append(out: Path, line: dict) -> None:
    with open(out / FILE, "a") as f:
        f.write(json.dumps(line) + "\n")


def train_config(opts: Options, argv: list[str]) -> config.Config:
    """train.py's Config of the flags after `--` (checked by config.parse_config), as the tool uses
    it: --algo stapo (so pi_old is a pass of its own and S2T's rule is known before the update; the
    arms choose their weights), the paper's rule per mini-batch (no --quantile-window)."""
    if any(a.split("=")[0] in ("--out-dir", "--resume", "--overwrite") for a in argv):
        raise ValueError("give --out-dir and --resume before `--`, not as train.py flags")
    cfg, _, notes = config.parse_config([*argv, "--out-dir", str(Path(opts.out_dir) / "unused")])
    if cfg.quantile_window:
        raise ValueError("--quantile-window: the tool applies the paper's rule per mini-batch")
    if not cfg.data or not cfg.heldout:
        raise ValueError("the held-out measures need --data with --heldout N > 0")
    return replace(cfg, algo="stapo")


def setup_state(opts: Options, cfg: config.Config):
    """The Run at the state: train.py's setup (a 1-process group), then the checkpoint's model,
    AdamW and schedule."""
    from distributed.process_group import init_distributed
    from startup.run import setup

    if opts.checkpoint and not (Path(opts.checkpoint) / "state.pt").is_file():
        raise FileNotFoundError(f"--checkpoint {opts.checkpoint} is not a train.py checkpoint "
                                "folder (no state.pt)")
    if not torch.distributed.is_initialized():
        init_distributed()
    run = setup(cfg, config.read_inputs(cfg, 1), 0, 1, torch.device("cpu"), None,
                run_folder.Preemption())
    release_freed_memory()
    if opts.checkpoint:
        run_folder.load_checkpoint(Path(opts.checkpoint), run_folder.ModelAndOptimizer(
            run.policy, run.optimizer, run.scheduler))
        release_freed_memory()
    return run


def held_out(run, opts: Options) -> HeldOut:
    """The held-out sets of the state: the worked solutions of the first --heldout-prompts
    problems, and the state's own first sample of each of the first --acc-prompts (the fixed
    responses)."""
    n, m = (k or len(run.test_rows) for k in (opts.heldout_prompts, opts.acc_prompts))
    pad = run.tokenizer.pad_token_id
    targets = [run.tokenizer(worked_solution(r, opts.solutions),
                             add_special_tokens=False).input_ids for r in run.test_rows[:n]]
    solutions, solution_target = teacher_forced(run.test_prompts[:n], targets, pad)
    prompts = run.test_prompts[:m]
    partial = HeldOut(solutions, solution_target, solutions, solution_target, prompts,
                      run.test_rows[:m])
    _, out = accuracy(run, partial, 1, opts.prompts_per_call)
    responses = [ids[k.bool()].tolist() for ids, k in zip(out.response_ids, out.response_mask)]
    return partial._replace(**dict(zip(("responses", "response_target"),
                                       teacher_forced(prompts, responses, pad))))


def scan(opts: Options, argv: list[str]) -> int:
    """Measure mini-batches from the state until --mini-batches are done (or --max-steps are
    scanned), one line each, continuing the lines of a stopped scan."""
    out = Path(opts.out_dir)
    errors.check_writable("--out-dir", out)
    lines = read_lines(out)
    if lines and opts.resume != "auto":
        raise ValueError(f"{out / FILE} holds a scan: continue it with --resume auto")
    cfg = train_config(opts, argv)
    label = opts.state or (Path(opts.checkpoint).name if opts.checkpoint else "initial")
    recipe = {"state": label, "checkpoint": opts.checkpoint, "train_flags": argv,
              **{k: v for k, v in asdict(opts).items()
                 if k not in ("out_dir", "resume", "mini_batches", "max_steps", "state")}}
    if lines and {k: lines[0].get(k) for k in recipe} != recipe:
        raise ValueError(f"{out / FILE} was made with other flags or another state: "
                         f"{json.dumps({k: lines[0].get(k) for k in recipe})}")
    run = setup_state(opts, cfg)
    held = held_out(run, opts)
    t0 = time.time()
    base = measure(run, held, opts)
    out.mkdir(parents=True, exist_ok=True)
    state = State(run, out / "state.pt", likelihood_gradient(run, held))
    if not lines:
        lines = [{"kind": "setup", **recipe, "base": base,
                  "heldout": [len(held.solutions), len(held.prompts)],
                  "tokens": [int(held.solution_target.sum()), int(held.response_target.sum())],
                  "seconds": time.time() - t0}]
        append(out, lines[0])
    elif any(not math.isclose(base[k], lines[0]["base"][k], abs_tol=1e-5) for k in OUTCOMES):
        raise ValueError(f"the state measures {base}, not the {lines[0]['base']} of {out / FILE}: "
                         "another checkpoint or code")
    done = {(x["step"], x["k"]) for x in lines if x["kind"] == "minibatch"}
    step = max([x["step"] for x in lines if x["kind"] == "scan"], default=opts.first_step - 1) + 1
    G, b = cfg.group_size, cfg.mini_batch_prompts * cfg.group_size
    bar = tqdm(total=opts.mini_batches, initial=min(len(done), opts.mini_batches),
               desc=f"{label} mini-batches", dynamic_ncols=True)
    while len(done) < opts.mini_batches and step <= opts.max_steps:
        t0 = time.time()
        batch, prompt_rows = train.sample(run, step)
        texts = batch.texts(run.tokenizer)
        rows = [run.rows[prompt_rows[i // G]] for i in range(len(texts))]
        rewards = torch.tensor(reward.rewards(texts, [r["answer"] for r in rows], cfg.reward, rows))
        advantages = stapo.group_advantages(rewards, G)
        near = (advantages[:, None] > 0) & (batch.response_mask > 0) & \
            (batch.sampler_logprobs < math.log(cfg.tau_p) + SCREEN_MARGIN)
        qualifying = []
        if near.any():  # else no candidate: S2T silences nothing in this rollout
            pi_old = train.old_policy_stats(run, batch)
            graded = graded_tokens(batch, run.tokenizer, cfg.reward)
            for k, mb in enumerate(train.mini_batches(run, step, batch, rewards, advantages,
                                                      pi_old)):
                g = graded[k * b:(k + 1) * b]
                rule = stapo.token_weights("stapo", mb.pi_old.logprobs, mb.pi_old.entropy,
                                           mb.advantages, mb.mask, cfg.tau_p, cfg.quantile,
                                           mb.context).silenced
                if not (rule & g).any():
                    continue
                qualifying.append(k)
                if (step, k) in done or len(done) >= opts.mini_batches:
                    continue
                t1 = time.time()
                m = cfg.mini_batch_prompts
                line = {"kind": "minibatch", "state": label, "step": step, "k": k,
                        "prompt_rows": prompt_rows[k * m:(k + 1) * m],
                        **measure_mini_batch(run, state, held, mb, g, opts),
                        "base": base, "seconds": time.time() - t1}
                append(out, line)
                done.add((step, k))
                bar.update()
        append(out, {"kind": "scan", "step": step, "responses": len(texts),
                     "screened": bool(near.any()), "qualifying": qualifying,
                     "seconds": time.time() - t0})
        bar.set_postfix({"step": step}, refresh=False)
        step += 1
    bar.close()
    state.path.unlink()
    print(f"{out / FILE}: {len(done)} mini-batches measured, steps up to {step - 1} scanned")
    return 0


# --------------------------------------------------------------------------------------- the report
def outcomes(line: dict) -> dict:
    """One measured mini-batch's outcomes (the plan's): primary, STAPO - JustRL in held-out
    log-likelihood change (nats per token); secondaries: STAPO - RandMask in it, STAPO - JustRL in
    the entropy change and the accuracy change, and the first-order cosine."""
    a = line["arms"]
    return {"primary": a["stapo"]["ll"] - a["justrl"]["ll"],
            "ll_vs_randmask": a["stapo"]["ll"] - a["randmask"]["ll"],
            "entropy": a["stapo"]["entropy"] - a["justrl"]["entropy"],
            "acc": a["stapo"]["acc"] - a["justrl"]["acc"],
            "cosine": line["first_order"]["cos"]}


SECONDARY = ("ll_vs_randmask", "entropy", "acc", "cosine")
PREDICTED = {"primary": 1, "ll_vs_randmask": 1, "entropy": -1, "acc": 1, "cosine": -1}  # plan's


def sd_upper(sd: float, n: int, level: float = 0.95) -> float:
    """The upper `level` confidence bound of a standard deviation from n values:
    sd sqrt((n - 1) / chi2_(1 - level)(n - 1))."""
    return sd * math.sqrt((n - 1) / chi2_quantile(1 - level, n - 1))


def pairs_needed(sd: float, delta: float, power: float = 0.8, alpha: float = 0.05) -> int:
    """Mini-batches a two-sided paired t-test at `alpha` needs for `power` at a mean difference
    `delta`: ((z_a + z_b) sd / delta)^2 + z_a^2 / 2 (the normal approximation with Guenther's
    correction for the t's tails), rounded up."""
    za, zb = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    return math.ceil(((za + zb) * sd / delta) ** 2 + za * za / 2)


def detectable(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The mean difference n mini-batches detect with `power` (`pairs_needed` solved for delta)."""
    za, zb = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    return (za + zb) * sd / math.sqrt(max(n - za * za / 2, 1e-9))


def test(values: list[float]) -> dict:
    """Two-sided one-sample t-test of the mean (the paired t-test of differences) and Wilcoxon's
    signed-rank test beside it."""
    w_plus, w_p = wilcoxon(values)
    return {**paired_t(values), "w_plus": w_plus, "w_p": w_p}


def reading(primary: dict, sesoi: float | None) -> str:
    """The plan's reading of the primary outcome (docs/experiments.md, fixed before the main
    runs)."""
    if primary["p"] < 0.05:
        fragile = "" if primary["w_p"] < 0.05 else " (Wilcoxon disagrees: fragile)"
        return ("supports the mechanism: STAPO's update leaves the held-out likelihood higher"
                if primary["mean"] > 0 else "refutes the mechanism: the silenced tokens' "
                "updates raise the held-out likelihood") + fragile
    if sesoi is not None and -sesoi < primary["ci90"][0] and primary["ci90"][1] < sesoi:
        return f"refutes at this scale: no effect of {sesoi:.2g} nats/token or more (90% interval)"
    return "cannot tell"


def secondary_reading(name: str, mean: float, holm_p: float) -> str:
    """The plan's reading of a secondary outcome: Holm p < 0.05 in the predicted direction
    supports, in the other refutes; otherwise cannot tell."""
    if holm_p >= 0.05:
        return "cannot tell"
    return "supports" if mean * PREDICTED[name] > 0 else "refutes"


def report(lines: list[dict], sesoi: float | None = SESOI) -> str:
    """The plan's statistics of measured mini-batches (all states pooled; per state
    descriptive)."""
    out = ["| state | mini-batches | silenced (graded) a mini-batch | dLL justrl / stapo / "
           "randmask (nats/token) | dH justrl / stapo | dacc justrl / stapo | first-order "
           "predicted dLL justrl | STAPO - JustRL dLL, mean (95% CI) | s a mini-batch |",
           "|---" * 9 + "|"]
    groups = [*dict.fromkeys(x["state"] for x in lines), "all"]  # each state, then all pooled
    for s in groups:
        mine = [x for x in lines if s in ("all", x["state"])]
        d = {(a, k): np.mean([x["arms"][a][k] - x["base"][k] for x in mine])
             for a in ARMS for k in OUTCOMES}
        p = paired_t([outcomes(x)["primary"] for x in mine]) if len(mine) > 1 else None
        cells = [" / ".join(f"{d[a, k]:{f}}" for a in arms) for k, f, arms in
                 (("ll", "+.2e", ARMS), ("entropy", "+.2e", ARMS[:2]), ("acc", "+.4f", ARMS[:2]))]
        out.append(f"| {s} | {len(mine)} | {np.mean([x['silenced'] for x in mine]):.2f} "
                   f"({np.mean([x['silenced_graded'] for x in mine]):.2f}) | {' | '.join(cells)} | "
                   f"{np.mean([x['arms']['justrl']['predicted'] for x in mine]):+.2e} | "
                   + (f"{p['mean']:+.2e} ({p['ci'][0]:+.2e}, {p['ci'][1]:+.2e})" if p else "-")
                   + f" | {np.mean([x['seconds'] for x in mine]):.0f} |")
    if len(lines) < 2:
        return "\n".join(out)
    values = {k: [outcomes(x)[k] for x in lines] for k in ("primary", *SECONDARY)}
    tests = {k: test(v) for k, v in values.items()}
    adjusted = dict(zip(SECONDARY, holm([tests[k]["p"] for k in SECONDARY])))
    out += ["", "| outcome | n | mean (95% CI) | sd | t-test p | Holm p | Wilcoxon p | "
            "predicted | the plan's reading |", "|---" * 9 + "|"]
    for k, t in tests.items():
        verdict = reading(t, sesoi).split(":")[0] if k == "primary" else \
            secondary_reading(k, t["mean"], adjusted[k])
        out.append(f"| {k} | {t['n']} | {t['mean']:+.3e} ({t['ci'][0]:+.3e}, {t['ci'][1]:+.3e}) "
                   f"| {t['sd']:.3e} | {t['p']:.4f} | "
                   f"{f'{adjusted[k]:.4f}' if k in adjusted else '-'} | {t['w_p']:.4f} | "
                   f"{'> 0' if PREDICTED[k] > 0 else '< 0'} | {verdict} |")
    chance = []  # RandMask - JustRL: as many candidates left out at random (descriptive)
    for s in groups:
        mine = [x["arms"]["randmask"]["ll"] - x["arms"]["justrl"]["ll"] for x in lines
                if s in ("all", x["state"])]
        t = test(mine) if len(mine) > 1 else None
        chance.append(f"{s} {t['mean']:+.2e} ({t['ci'][0]:+.2e}, {t['ci'][1]:+.2e}; t p "
                      f"{t['p']:.3f}, Wilcoxon p {t['w_p']:.3f})" if t else f"{s} -")
    out += ["", "RandMask - JustRL dLL (not pre-registered: as many candidates left out, at "
            "random): " + "; ".join(chance)]
    sd, n = tests["primary"]["sd"], tests["primary"]["n"]
    justrl = float(np.mean([abs(x["arms"]["justrl"]["ll"] - x["base"]["ll"]) for x in lines]))
    upper = sd_upper(sd, n)
    share = f"{tests['primary']['mean'] / justrl:+.2e} of it" if justrl else "(no share of 0)"
    out += ["", f"primary sd {sd:.3e} (upper 95% bound {upper:.3e}, chi-square, {n - 1} df); "
            f"mean |dLL| of JustRL's update {justrl:.3e} nats/token; the primary's mean is {share}"]
    if sesoi:
        out.append(f"SESOI {sesoi:.3e}: 80% power at alpha 0.05 needs {pairs_needed(sd, sesoi)} "
                   f"mini-batches (at the upper sd: {pairs_needed(upper, sesoi)}); {n} detect "
                   f"{detectable(sd, n):.3e}")
    out.append(f"reading (the plan's rules): {reading(tests['primary'], sesoi)}")
    return "\n".join(out)


def report_main(argv: list[str]) -> int:
    """`--report DIR [DIR ...] [--sesoi X]`: the measured lines of every DIR pooled."""
    sesoi = SESOI
    if "--sesoi" in argv[:-1]:
        i = argv.index("--sesoi")
        try:
            sesoi = float(argv[i + 1])
        except ValueError:
            return errors.error(PROG, f"--sesoi takes a number, not {argv[i + 1]!r}")
        argv = argv[:i] + argv[i + 2:]
    missing = [d for d in argv if not (Path(d) / FILE).is_file()]
    if not argv or missing or any(d.startswith("-") for d in argv):
        why = f" (no {FILE} in {', '.join(missing)})" if missing else ""
        return errors.error(PROG, f"--report DIR [DIR ...] [--sesoi X] needs folders the tool "
                            f"wrote{why}")
    lines = [x for d in argv for x in run_folder.read_log(Path(d) / FILE)
             if x.get("kind") == "minibatch"]
    if not lines:
        return errors.error(PROG, f"no measured mini-batch in {', '.join(argv)}")
    print(report(lines, sesoi))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report"]:
        return report_main(argv[1:])
    own, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    opts = Options(**flags.parse_flags(Options, own, PROG))
    owned = not torch.distributed.is_initialized()  # the 1-process group setup_state makes
    try:
        if not opts.out_dir:
            raise ValueError("give --out-dir DIR (and train.py's flags after `--`)")
        if min(opts.mini_batches, opts.first_step, opts.acc_samples, opts.prompts_per_call) < 1 \
                or min(opts.heldout_prompts, opts.acc_prompts) < 0:
            raise ValueError("--mini-batches, --first-step, --acc-samples and --prompts-per-call "
                             "must be >= 1, --heldout-prompts and --acc-prompts >= 0")
        return scan(opts, train_argv)
    except errors.BAD_INPUT as e:
        return errors.error(PROG, e)
    finally:
        if owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
