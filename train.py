"""Train a causal LM with STAPO or a baseline by RL on verifiable math rewards (docs/paper.md §3-§4 and
Algorithm 1; the recipe of §6), on 1 CPU, 1 GPU or many GPU nodes with the same code.

    python train.py                                    # no GPU: the CPU default (SmolLM2-135M, built-in sums)
    torchrun --standalone --nproc_per_node=2 train.py --out-dir out/train-cpu-2   # the same, 2 processes
    python train.py --model Qwen/Qwen3-1.7B-Base       # 1 GPU: the paper's recipe (DAPO-Math-17k, G = 8)
    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py \\
        --model Qwen/Qwen3-8B-Base --out-dir runs/stapo-8b --resume auto   # 64 GPUs, as in the paper
    python train.py --plot runs/stapo runs/justrl      # the runs' curves overlaid (plots.py)

Reading order: `train_step` (one RL step, numbered 1-4) and the functions it calls, in the order it calls them;
`StepLog`, its metrics; `train`, the loop; then the data positions and the rollout engine, `setup`, the
distributed helpers, and `Config` with the command line (`parse_config`, `main`). The data come from data.py,
the run folder (checkpoints, logs, resume, stop signals) is run_folder.py.

Deliberate differences from the paper's veRL setup:
1. Presets: `--preset auto` is `paper` (§6) on CUDA and `cpu` (SmolLM2-135M on built-in sums, minutes)
   otherwise; a flag given on the command line always wins; each value lives once, in `Config` or `CPU_PRESET`.
2. pi_old log-probs are recomputed by the training forward (as veRL does), not taken from the sampler (their
   distance is `rollout/logprob_diff`). On policy (one mini-batch per step, JustRL or GRPO, no TIS: `on_policy`)
   the update's own forward gives them, detached, instead of a separate pass (TRL's num_iterations=1).
3. Sampling noise is seeded per generate call from (seed, step, global index of its first prompt): rollouts are
   reproducible on resume, and with `--rollout-chunk 1` independent of the number of ranks. The held-out
   evaluation samples each problem in a call of its own, seeded by the problem: independent of the ranks always.
4. Mini-batch k is the same set of prompts for any number of ranks (rank r holds the r-th slice of each); the
   S2T threshold, the denominator and the metrics are reduced over all ranks.
5. FSDP2 averages gradients over ranks; each rank backpropagates world_size * (its sum / global denominator).
6. A mini-batch whose advantages are all zero is skipped (no optimizer step, no weight decay) unless GRPO's KL
   term still gives it a gradient; a non-finite gradient norm skips the step with a warning.
7. Prompts longer than --max-prompt-len are dropped and counted (veRL filters them too); one whose problem has more
   characters than that many tokens can spell is dropped before it is tokenized.
8. Sampling: rollout.generate (HF model + KV cache) by default, or a colocated vLLM engine per rank (--rollout
   vllm); the cpu preset uses a raw-text prompt ("...\\nThe answer is") at the paper's T = 1.0.
9. Steps count from 1 in every file, on the console and in checkpoint/step_N.
"""
from __future__ import annotations

import importlib.util
import math
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Literal, NamedTuple

# A stop signal that comes while the modules below load (seconds on a busy machine) waits, blocked, until main's
# run_folder.Preemption takes it over; without this it killed the run (exit 143, no stopped.json).
if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})

# MKL's conditional numerical reproducibility, set before torch loads MKL: without it MKL may pick, per call, a
# summation order that depends on memory alignment. With the deterministic kernels of `setup`, two runs of one
# command (or a run and its resume) agree bit for bit at a fixed thread count (docs/training.md, Reproducibility).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402 - after MKL_CBWR
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import cli  # noqa: E402
import plots  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
import run_folder  # noqa: E402
import s2t  # noqa: E402
import stapo  # noqa: E402
from data import load_rows, problem_seed, repeated_note  # noqa: E402
from model import (Policy, TokenStats, from_rank0, init_distributed, kv_cache_bytes, lm_vocab_size,  # noqa: E402
                   load_model, memory_estimate, memory_line, shard_policy)


# ------------------------------------------------------------------------------------------------- the step
@dataclass
class Run:
    """A run's state between steps (`setup` makes it): the configuration, the process, the models, the data."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    policy: Policy
    ref_policy: Policy | None  # GRPO's reference model (--kl-beta > 0), else None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: object  # the rollout engine (rollout.make_engine)
    rows: list[dict]  # training problems {"problem", "answer"} (data.py) and their prompts (token ids)
    prompts: list[list[int]]
    test_rows: list[dict]  # held-out problems and their prompts
    test_prompts: list[list[int]]
    preemption: run_folder.Preemption  # stop signals (SIGTERM, SIGUSR1) on any rank
    logger: run_folder.Logger | None  # --logger (rank 0)
    start: int = 0  # steps already done (a resumed run)


class StepResult(NamedTuple):
    """What a step writes: its metrics.jsonl line and its lines of spurious.jsonl, samples.jsonl and
    tokens.jsonl."""
    metrics: dict
    spurious: list[dict]
    samples: list[dict]
    tokens: list[dict]


def train_step(run: Run, step: int, on_mask: Callable | None = None) -> StepResult | None:
    """Step `step` (counted from 1): one rollout batch and its mini-batch updates (paper Algorithm 1); None when a
    stop signal came during the rollout (nothing was updated). on_mask(k, mb, current, weights), if given, sees each
    mini-batch's decision (counterfactual.py replays a step with it)."""
    cfg, G, device, policy = run.cfg, run.cfg.group_size, run.device, run.policy
    t0 = time.time()
    # 1. G responses to each of this rank's prompts of the step (difference 3: seeded per generate call).
    batch, prompt_rows = sample(run, step)  # prompt_rows: the training row of each prompt
    if run.preemption.agreed():  # a stop signal came during the rollout: drop the step (run_folder.Preemption)
        return None
    # 2. Rewards R_i and group advantages A_i = (R_i - mean_j R_j) / (std_j R_j + eps); groups never span ranks.
    texts = batch.texts(run.tokenizer)
    answers = [run.rows[prompt_rows[i // G]]["answer"] for i in range(len(texts))]
    rewards = torch.tensor([reward.reward(t, a, cfg.reward) for t, a in zip(texts, answers)])  # (B,)
    advantages = stapo.group_advantages(rewards, G).to(device)  # (B,)
    adv = advantages[:, None].expand_as(batch.logprobs)  # (B, T): every token of y_i gets A_i
    # 3. pi_old: log-probs, entropy and collision of the policy before the step's updates (difference 2): one
    #    no-grad pass, or None on policy, where the first update's own forward returns them.
    old = None if on_policy(cfg) else token_stats(policy, batch, cfg, device)  # TokenStats of (B, T) each
    ref_logprobs = token_stats(run.ref_policy, batch, cfg, device).logprobs if run.ref_policy else None
    log = StepLog(run, step, batch, rewards, advantages, time.time() - t0)
    log.samples = completions(run, step, "train", texts, rewards.tolist(), prompt_rows, G)

    # 4. Mini-batch updates, each with the token weights of its own p and H (paper Algorithm 1).
    t0 = time.time()
    policy.train()
    rows_per_mb = cfg.mini_batch_prompts // run.world * G  # this rank's rows of one mini-batch
    for k, first in enumerate(range(0, len(batch), rows_per_mb)):
        rows = slice(first, first + rows_per_mb)
        mb = MiniBatch(batch.select(rows), adv[rows], None if old is None else old.logprobs[rows],
                       None if ref_logprobs is None else ref_logprobs[rows], rewards[rows] > 0)
        # p, H (and collision) of the current policy: pi_old's before the first update (on policy: not yet known)
        if k > 0:
            current = token_stats(policy, mb.rollout, cfg, device)
        else:
            current = None if old is None else old.rows(rows)
        # The algorithm's token weights I_it (S2T: the mask, tau_h over the whole mini-batch) and the global N.
        p, H = (None, None) if current is None else (current.logprobs, current.entropy)  # None: not needed
        keys = random_keys(run, step, k, mb) if stapo.ALGORITHMS[cfg.algo].silence == "random" else None  # (b, T)
        weights = stapo.token_weights(cfg.algo, p, H, mb.advantages, mb.mask, cfg.tau_p, cfg.quantile,
                                      gather=all_gather_cat, keys=keys)
        denominator, nonzero = all_sum(weights.denominator, ((mb.advantages != 0) & (weights.weights > 0)).sum())
        loss_weights = weights.weights  # (b, T)
        if cfg.tis_cap is not None:  # truncated importance sampling: min(pi_old / pi_sampler, cap) per token
            loss_weights = loss_weights * stapo.tis_weight(mb.old_logprobs, mb.rollout.logprobs, cfg.tis_cap)
        skip = nonzero == 0 and run.ref_policy is None  # all-zero advantages, no KL term: no update (diff. 6)
        run.optimizer.zero_grad(set_to_none=True)
        update = None if skip else accumulate_gradients(run, mb, loss_weights, denominator)
        if current is None:  # on policy: pi_old is the update's own forward, detached (a pass if it made none)
            current = update.forward if update else token_stats(policy, mb.rollout, cfg, device)
            old = current
        log.s2t(k, mb, current, weights)
        if on_mask:
            on_mask(k, mb, current, weights)
        if skip:
            log.counts["skipped/zero_adv"] += 1
            continue
        log.add(update.sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(grad_norm):  # the norm is global, so every rank skips together
            warnings.warn(f"step {step} mini-batch {k}: non-finite gradient norm, update skipped")
            run.optimizer.zero_grad(set_to_none=True)
            log.counts["skipped/nonfinite"] += 1
            continue
        run.optimizer.step()
        run.scheduler.step()
        log.updated(grad_norm, update)
        if cfg.entropy_change:  # what the update did to the entropy of the mini-batch's positions, per kind
            log.entropy_change(k, mb, current, token_stats(policy, mb.rollout, cfg, device).entropy, weights)
    run.optimizer.zero_grad(set_to_none=True)
    log.pi_old(batch, old)
    return log.close(time.time() - t0)


def random_keys(run: Run, step: int, k: int, mb: MiniBatch) -> torch.Tensor:
    """(b, T) randmask's keys for this rank's rows of mini-batch k of step `step`: seeded from (seed, step, k) and
    each row's place in the whole mini-batch (rank_slice: rank r holds rows r*b .. r*b+b-1), so the silenced
    positions are the same on every number of ranks."""
    b, T = mb.rollout.response_ids.shape
    rows = range(run.rank * b, (run.rank + 1) * b)
    return s2t.random_keys(hash((run.cfg.seed, step, k)) % 2**62, rows, run.cfg.max_response_len)[:, :T]


def on_policy(cfg: Config) -> bool:
    """Whether the update's own forward stands in for the pi_old pass: one mini-batch per step (the policy has
    not moved when that forward runs, so pi_old = its log-probs, detached: ratio 1), weights that need no p or H
    before it (JustRL, GRPO) and no TIS (which weighs by pi_old before the loss)."""
    return cfg.mini_batch_prompts == cfg.prompts_per_step and stapo.ALGORITHMS[cfg.algo].silence is None and \
        cfg.tis_cap is None


def sample(run: Run, step: int) -> tuple[rollout.Rollout, list[int]]:
    """(this rank's rollout batch of step `step` on the policy's device, the training row of each prompt): its
    prompts in mini-batch order (`rank_slice`), each generate call seeded from (seed, step, global index of its
    first prompt) (difference 3)."""
    cfg, position = run.cfg, step - 1  # the steps before this one: the data position
    indices = prompt_indices(position, len(run.rows), cfg)
    positions = rank_slice(len(indices), cfg, run.rank, run.world)
    prompt_rows = [indices[i] for i in positions]
    chunk = prompts_per_call(cfg, len(prompt_rows), run.policy.lm.config, compute_dtype(cfg, run.device).itemsize)
    seeds = [hash((cfg.seed, position, position * cfg.prompts_per_step + i)) % 2**62 for i in positions[::chunk]]
    run.policy.eval()
    with run.engine.ready(run.policy):  # plain: parameters gathered; vllm: current weights pushed
        batch = run.engine.sample([run.prompts[i] for i in prompt_rows], cfg.group_size, seeds, chunk,
                                  cfg.max_response_len, cfg.temperature, cfg.top_p)
    return batch.to(run.device), prompt_rows  # the engine's device (vLLM: the CPU) -> the policy's


@dataclass
class MiniBatch:
    """This rank's rows of one mini-batch and what their update reads."""
    rollout: rollout.Rollout
    advantages: torch.Tensor  # (b, T): A_i on every token of y_i
    old_logprobs: torch.Tensor | None  # (b, T) pi_old; None on policy (the update's own forward gives it)
    ref_logprobs: torch.Tensor | None  # (b, T) GRPO's reference model with --kl-beta > 0, else None
    correct: torch.Tensor  # (b,) bool: a positive reward

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.response_mask.float()  # (b, T)


class Update(NamedTuple):
    """What `accumulate_gradients` did on this rank."""
    loss: float  # the policy loss -J of this rank's rows
    kl: float  # GRPO's KL term (0 without --kl-beta)
    sums: dict  # token counts and token-weighted clip statistics, for StepLog
    forward: TokenStats | None  # on policy: p, H, collision of the forward, detached, (b, T) each (pi_old)


def accumulate_gradients(run: Run, mb: MiniBatch, weights: torch.Tensor, denominator: float) -> Update:
    """The gradient of one mini-batch's objective J (paper Eq. 3, stapo.policy_loss) accumulated over token-budget
    micro-batches, no optimizer step: sum_micro sum_ranks (world * loss_part) / world = J's gradient, however the
    rows are grouped. weights (b, T): the token weights I_it; denominator: the global N."""
    cfg, device = run.cfg, run.device
    sums = dict.fromkeys(("computed_tokens", "attention_cells", "real_tokens", "loss_tokens", *CLIP_STATS), 0.0)
    micro = mb.rollout.micro_batches(cfg.max_tokens_per_micro_batch, agree=all_max)  # same count on every rank
    for rows in micro:  # tokens the backbone runs (a shared prompt once), cells attention lays out
        computed, cells = mb.rollout.select(rows).packed_sizes()
        sums["computed_tokens"] += computed
        sums["attention_cells"] += cells
    sums["real_tokens"] += mb.rollout.lengths().sum().item()
    forward = None if mb.old_logprobs is not None else TokenStats(*(torch.zeros_like(mb.rollout.logprobs)
                                                                     for _ in range(3)))
    loss_sum = kl_sum = 0.0
    for rows in micro:
        new = policy_forward(run.policy, mb.rollout.select(rows), cfg, device)  # TokenStats, each (b', T')
        cut = (rows, slice(0, new.logprobs.shape[1]))
        if forward is not None:  # on policy: pi_old is this forward's log-probs, detached (ratio 1)
            for whole, piece in zip(forward, new):
                whole[cut] = piece.detach()
        old = mb.old_logprobs if forward is None else forward.logprobs
        loss, stats = stapo.policy_loss(new.logprobs, old[cut].to(device), mb.advantages[cut].to(device),
                                        weights[cut].to(device), *clip_range(cfg), cfg.dual_clip, denominator)
        if mb.ref_logprobs is not None:  # GRPO with --kl-beta > 0: + beta * sum(I * k3) / N
            kl = (weights[cut].to(device) * stapo.kl_k3(new.logprobs, mb.ref_logprobs[cut].to(device))).sum()
            kl = kl / max(denominator, 1.0)
            loss = loss + cfg.kl_beta * kl
            kl_sum += kl.item()
        (loss * run.world).backward()  # FSDP2 divides the summed gradient by world (difference 5)
        loss_sum += loss.item()
        tokens = stats["loss/tokens"].item()
        sums["loss_tokens"] += tokens
        for key in CLIP_STATS:
            sums[key] += stats[key].item() * tokens if key in stats else 0.0  # token-weighted means
    return Update(loss_sum, kl_sum, sums, forward)


CLIP_STATS = ("clip/frac_low", "clip/frac_high", "clip/frac_dual", "ratio/mean", "kl/approx")  # policy_loss's


def clip_range(cfg: Config) -> tuple[float, float]:
    """(eps_low, eps_high): --clip-low / --clip-high, or the algorithm's (stapo.ALGORITHMS)."""
    low, high = stapo.ALGORITHMS[cfg.algo].clip
    return low if cfg.clip_low is None else cfg.clip_low, high if cfg.clip_high is None else cfg.clip_high


def policy_forward(policy, rows: rollout.Rollout, cfg: Config, device) -> TokenStats:
    """p, H and collision of `policy` on `rows`, each (B, T') with T' <= T: all-padding prompt columns (left) and
    response columns (right) are dropped first."""
    P = rows.prompt_ids.shape[1]
    p0 = int((rows.prompt_mask.sum(0) > 0).nonzero()[0])
    t1 = int((rows.response_mask.sum(0) > 0).nonzero()[-1]) + 1
    input_ids, attention_mask = (x[:, p0:P + t1].to(device) for x in rows.training_inputs())  # (B, P - p0 + T')
    return policy(input_ids, attention_mask, rows.response_mask[:, :t1].to(device), temperature=cfg.temperature,
                  chunk_size=cfg.chunk_size)


def token_stats(policy, batch: rollout.Rollout, cfg: Config, device) -> TokenStats:
    """p, H and collision of the current policy, each (B, T) of the rollout's T on `device`, micro-batch by
    micro-batch without gradients."""
    whole = TokenStats(*(torch.zeros(batch.response_ids.shape, device=device) for _ in range(3)))
    with torch.no_grad():
        for rows in batch.micro_batches(cfg.max_tokens_per_micro_batch, agree=all_max):  # same count on every rank
            for values, piece in zip(whole, policy_forward(policy, batch.select(rows), cfg, device)):
                values[rows, :piece.shape[1]] = piece.float()
    return whole


ENTROPY_KINDS = ("silenced", "candidate", "other")  # s2t.entropy_change's kinds of token
CELLS = tuple(f"{kind}_{part}" for kind in s2t.TOKEN_KINDS for part in s2t.PARTS)  # s2t.token_cells' keys


def graded_tokens(batch: rollout.Rollout, tokenizer, mode: str) -> torch.Tensor:
    """(B, T) bool: each response's graded part (`graded_count`), the rest of it being the text after the answer."""
    graded = torch.zeros(batch.response_ids.shape, dtype=torch.bool)
    for i, (ids, mask) in enumerate(zip(batch.response_ids, batch.response_mask)):
        graded[i, :graded_count(tokenizer, ids[mask.bool()].tolist(), mode)] = True
    return graded


def graded_count(tokenizer, ids: list[int], mode: str) -> int:
    """How many leading tokens of a response (ids) hold the characters the reward reads (reward.graded_chars): the
    fewest whose decoded text has them, by bisection on the decoded length of the response's prefixes."""
    chars = reward.graded_chars(tokenizer.decode(ids, skip_special_tokens=True), mode)
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars else (mid + 1, hi)
    return lo


class StepLog:
    """The metric bookkeeping of one step: sums over this rank's sequences and tokens, reduced over ranks once, in
    `close`, into the metrics.jsonl line (docs/outputs.md, Metrics glossary), and the step's spurious.jsonl,
    samples.jsonl and tokens.jsonl records."""

    def __init__(self, run: Run, step: int, batch: rollout.Rollout, rewards, advantages, t_rollout: float):
        self.run, self.step, self.t_rollout = run, step, t_rollout
        mask = batch.response_mask.float()  # (B, T)
        self.sums = {"reward": rewards.sum(), "correct": (rewards > 0).sum(),  # a positive reward is correct
                     "seqs": len(batch), "tokens": mask.sum(), "truncated": batch.truncated.sum(),
                     "zero_adv": (advantages == 0).sum()}
        self.sums |= dict.fromkeys(["entropy", "logprob_diff", "s2t/candidates", "s2t/silenced", "kept",
                                    "silenced_p", "silenced_h", "gn_silenced", "gn_kept", "loss/policy", "loss/kl",
                                    "loss_tokens", *CLIP_STATS, "computed_tokens", "attention_cells",
                                    "real_tokens"], 0.0)
        self.sums |= dict.fromkeys([f"entropy_change/{kind}_{x}" for kind in ENTROPY_KINDS for x in ("sum", "n")],
                                   0.0)
        self.counts = {"updates": 0, "skipped/zero_adv": 0, "skipped/nonfinite": 0}  # equal on every rank
        self.grad_norm_sum = 0.0
        self.graded = None  # --entropy-change: (B, T) bool, the graded part of each response (graded_tokens)
        if run.cfg.entropy_change:
            self.graded = graded_tokens(batch, run.tokenizer, run.cfg.reward)
            self.sums |= dict.fromkeys([f"shares/{x}_{cell}" for x in ("grad", "n", "dH", "dHn") for cell in CELLS],
                                       0.0)
        self.spurious, self.samples, self.tokens = [], [], []

    def s2t(self, k: int, mb: MiniBatch, current: TokenStats, weights: stapo.TokenWeights) -> None:
        """What the mask did in mini-batch k, from p, H and pi_old before its update: counts, p, H and closed-form
        logit-gradient norms (w = r A, 0 where clipped) of silenced vs kept tokens, up to --spurious-per-step
        spurious.jsonl lines and a tokens.jsonl record."""
        cfg, tokenizer, ids = self.run.cfg, self.run.tokenizer, mb.rollout.response_ids
        old = current.logprobs if mb.old_logprobs is None else mb.old_logprobs
        w = stapo.surrogate_weight(current.logprobs, old, mb.advantages, *clip_range(cfg), cfg.dual_clip)  # (b, T)
        diag = s2t.diagnostics(current, mb.advantages, mb.mask, weights.silenced, cfg.tau_p, w=w)
        if self.graded is not None:  # the closed-form logit-gradient norm per kind of token and part of the response
            g = s2t.grad_norm_logits(w, current.logprobs, current.collision)  # (b, T)
            for cell, sel in self.cells(k, mb, current).items():
                self.sums[f"shares/grad_{cell}"] += g[sel].sum().item()
                self.sums[f"shares/n_{cell}"] += sel.sum().item()
        n_sil, n_kept = diag["s2t/silenced"], mb.mask.sum().item() - diag["s2t/silenced"]
        for key, value in [("s2t/candidates", diag["s2t/candidates"]), ("s2t/silenced", n_sil), ("kept", n_kept),
                           ("silenced_p", n_sil * diag["s2t/silenced_p_mean"]),
                           ("silenced_h", n_sil * diag["s2t/silenced_h_mean"]),
                           ("gn_silenced", n_sil * diag["s2t/grad_norm_silenced"]),
                           ("gn_kept", n_kept * diag["s2t/grad_norm_kept"])]:
            self.sums[key] += value
        left = max(cfg.spurious_per_step - len(self.spurious), 0)
        self.spurious += [{"step": self.step, "mini_batch": k, "token": tokenizer.decode([int(ids[i, t])]),
                           "context": tokenizer.decode(ids[i, max(0, t - 12):t].tolist()),
                           "p": math.exp(float(current.logprobs[i, t])), "H": float(current.entropy[i, t]),
                           "advantage": float(mb.advantages[i, t])}
                          for i, t in weights.silenced.nonzero().tolist()[:left]]
        if cfg.token_sample:  # what S2T saw: a seeded sample of the mini-batch's tokens for OUT/tokens.jsonl
            gen = torch.Generator().manual_seed(hash((cfg.seed, self.step - 1, k, self.run.rank)) % 2**62)
            sampled = s2t.token_sample(current, mb.advantages, mb.mask, weights.silenced, cfg.token_sample, gen,
                                     cfg.tau_p, w)
            self.tokens.append(token_record(self.step, k, weights.threshold, sampled, mb.correct))

    def add(self, sums: dict) -> None:
        """Token counts and clip statistics of a mini-batch's forward (accumulate_gradients)."""
        for key, value in sums.items():
            self.sums[key] += value

    def updated(self, grad_norm: float, update: Update) -> None:
        """An optimizer step was made: its gradient norm and this rank's losses."""
        self.counts["updates"] += 1
        self.grad_norm_sum += grad_norm
        self.sums["loss/policy"] += update.loss
        self.sums["loss/kl"] += update.kl

    def entropy_change(self, k: int, mb: MiniBatch, before: TokenStats, after: torch.Tensor,
                       weights: stapo.TokenWeights) -> None:
        """--entropy-change: the entropy at mini-batch k's positions before its update (with the p that makes
        the candidates) and after it (b, T), summed per kind of token (s2t.entropy_change) and per kind x part
        (s2t.token_cells)."""
        candidates = s2t.candidates(before.logprobs, mb.advantages, mb.mask, self.run.cfg.tau_p)  # (b, T)
        for key, value in s2t.entropy_change(before.entropy, after, mb.mask, weights.silenced, candidates).items():
            self.sums[key] += value
        delta = (after - before.entropy).float()  # (b, T) dH
        for cell, sel in self.cells(k, mb, before).items():
            self.sums[f"shares/dH_{cell}"] += delta[sel].sum().item()
            self.sums[f"shares/dHn_{cell}"] += sel.sum().item()

    def cells(self, k: int, mb: MiniBatch, current: TokenStats) -> dict[str, torch.Tensor]:
        """Mini-batch k's response tokens split into kind x part (s2t.token_cells), each (b, T) bool."""
        b = len(mb.rollout)
        graded = self.graded[k * b:(k + 1) * b].to(mb.mask.device)  # (b, T)
        return s2t.token_cells(current.logprobs, mb.advantages, mb.mask, graded, self.run.cfg.tau_p)

    def pi_old(self, batch: rollout.Rollout, old: TokenStats) -> None:
        """pi_old's entropy and its distance from the sampler's log-probs, over the step's tokens (each (B, T))."""
        mask = batch.response_mask.float()  # (B, T)
        self.sums["entropy"] += (old.entropy * mask).sum()
        self.sums["logprob_diff"] += ((old.logprobs - batch.logprobs).abs() * mask).sum()

    def close(self, t_update: float) -> StepResult:
        """The step's metrics.jsonl line from the sums of all ranks, and its other records."""
        tot = dict(zip(self.sums, all_sum(*self.sums.values())))
        counts, updates = self.counts, self.counts["updates"]

        def mean(key, n):
            return tot[key] / max(n, 1)

        n_seq, n_tok, n_loss = tot["seqs"], tot["tokens"], tot["loss_tokens"]
        n_sil, n_kept, t_rollout = tot["s2t/silenced"], tot["kept"], self.t_rollout
        metrics = {
            "step": self.step, "reward/mean": mean("reward", n_seq), "reward/acc": mean("correct", n_seq),
            "response/len_mean": mean("tokens", n_seq), "response/truncated_frac": mean("truncated", n_seq),
            "entropy/mean": mean("entropy", n_tok), "rollout/logprob_diff": mean("logprob_diff", n_tok),
            "adv/zero_frac": mean("zero_adv", n_seq),
            "s2t/candidates": tot["s2t/candidates"], "s2t/silenced": n_sil,
            "s2t/silenced_frac": mean("s2t/silenced", n_sil + n_kept),
            "s2t/silenced_p_mean": mean("silenced_p", n_sil), "s2t/silenced_h_mean": mean("silenced_h", n_sil),
            "s2t/grad_norm_silenced": mean("gn_silenced", n_sil), "s2t/grad_norm_kept": mean("gn_kept", n_kept),
            "loss/policy": mean("loss/policy", updates), "loss/kl": mean("loss/kl", updates),
            "clip/frac_low": mean("clip/frac_low", n_loss), "clip/frac_high": mean("clip/frac_high", n_loss),
            "clip/frac_dual": mean("clip/frac_dual", n_loss),
            "batch/pad_frac": 1 - tot["real_tokens"] / tot["attention_cells"] if tot["attention_cells"] else 0.0,
            "batch/shared_frac": 1 - tot["computed_tokens"] / tot["real_tokens"] if tot["real_tokens"] else 0.0,
            "ratio/mean": mean("ratio/mean", n_loss), "kl/approx": mean("kl/approx", n_loss),
            "grad_norm": self.grad_norm_sum / max(updates, 1), "lr": self.run.scheduler.get_last_lr()[0],
            **{k: float(v) for k, v in counts.items()},
            "time/rollout_s": t_rollout, "time/update_s": t_update,
            "tokens_per_s": n_tok / max(t_rollout + t_update, 1e-9),
        }
        if self.run.cfg.entropy_change:  # mean H_after - H_before over the step's updates, per kind of token
            metrics |= {f"entropy_change/{kind}": mean(f"entropy_change/{kind}_sum", tot[f"entropy_change/{kind}_n"])
                        for kind in ENTROPY_KINDS}
            g_all = sum(tot[f"shares/grad_{cell}"] for cell in CELLS)
            for cell in CELLS:  # share of the summed logit-gradient norm, tokens, mean entropy change per update
                metrics[f"shares/grad_{cell}"] = tot[f"shares/grad_{cell}"] / g_all if g_all else 0.0
                metrics[f"shares/n_{cell}"] = tot[f"shares/n_{cell}"]
                metrics[f"shares/dH_{cell}"] = mean(f"shares/dH_{cell}", tot[f"shares/dHn_{cell}"])
        return StepResult(metrics, self.spurious, self.samples, self.tokens)


def completions(run: Run, step: int, split: str, texts: list[str], rewards: list[float], prompt_rows: list[int],
                group_size: int) -> list[dict]:
    """samples.jsonl records of the first response to each of the first --samples-per-step prompts of `split`
    ("train" or "heldout"): the prompt as the model saw it, the response, the gold answer and the reward
    (texts[i] answers prompt_rows[i // group_size])."""
    rows, prompts = (run.rows, run.prompts) if split == "train" else (run.test_rows, run.test_prompts)
    return [{"step": step, "split": split, "prompt": run.tokenizer.decode(prompts[r]),
             "response": texts[j * group_size], "answer": rows[r]["answer"], "reward": rewards[j * group_size]}
            for j, r in enumerate(prompt_rows[:run.cfg.samples_per_step])]


def token_record(step: int, k: int, threshold: float | None, sampled: dict, correct: torch.Tensor) -> dict:
    """One line of tokens.jsonl: the tokens `s2t.token_sample` drew from mini-batch k of step `step`, as columns
    (floats to 4 significant digits); `correct` (b,) bool per response of the mini-batch."""
    rows = sampled["row"]
    return {"step": step, "mini_batch": k, "tau_h": threshold,
            **{key: [float(f"{v:.4g}") for v in sampled[key].tolist()] for key in ("p", "H", "A", "grad_norm",
                                                                                 "weight")},
            "correct": correct.cpu()[rows].int().tolist(), "candidate": sampled["candidate"].int().tolist(),
            "silenced": sampled["silenced"].int().tolist()}


# ------------------------------------------------------------------------------------------------- the loop
def train(run: Run) -> int:
    """The training loop: steps, their logs, evaluations, checkpoints, the export. Returns the exit status: 0, or
    run_folder.STOPPED when a stop signal ended the run early (with a checkpoint). Step N (from 1) is the same N
    in the console, every log (eval.jsonl: evaluated after N steps, 0 = before training) and checkpoint/step_N."""
    cfg, start = run.cfg, run.start
    evaluated = {r["step"] for r in run_folder.read_log(Path(cfg.out_dir) / "eval.jsonl")[0]}
    stopped = eval_due(run, start) and start not in evaluated and not run_eval(run, start)  # a resume's due one
    where = f"in the evaluation after {plural(start, 'step')} (it runs again on resume)"  # where a stop came
    saved = done = start  # the steps of the last checkpoint (a new run has none: 0), the steps done
    with tqdm(total=cfg.steps, initial=start, desc=f"{cfg.algo} steps", dynamic_ncols=True,
              disable=run.rank != 0) as bar:  # closed also when an error leaves the loop
        for step in range(start + 1, cfg.steps + 1):
            if stopped:
                break
            result = train_step(run, step)
            if result is None:  # a stop signal during the rollout
                stopped, where = True, f"in step {step}'s rollout (the step is dropped)"
                break
            done = step
            write(run, {"spurious.jsonl": gather(result.spurious)[:cfg.spurious_per_step],
                        "samples.jsonl": gather(result.samples)[:cfg.samples_per_step],
                        "tokens.jsonl": ranks_joined(gather([result.tokens])),
                        "metrics.jsonl": [result.metrics]})
            bar.set_postfix({"train_acc": f"{result.metrics['reward/acc']:.2f}",  # silenced: tokens, as at the end
                             "H": f"{result.metrics['entropy/mean']:.2f}",
                             "silenced": int(result.metrics["s2t/silenced"])}, refresh=False)
            bar.update()
            if step == cfg.steps:
                bar.close()  # the final bar once, above the closing lines
            warn_if_no_gradient(run, result.metrics)
            stopped, where = run.preemption.agreed(), f"in step {step} (its updates finished)"  # one all-reduce
            if not stopped and eval_due(run, step) and not run_eval(run, step):
                stopped, where = True, f"in the evaluation after {plural(step, 'step')} (it runs again on resume)"
            if not stopped and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
                saved = checkpoint(run, step)  # a stop writes its own (`stop`)
    if stopped:
        return stop(run, done, saved, where)
    finish(run)
    return 0


def write(run: Run, records: dict[str, list[dict]]) -> None:
    """Append records to the run folder's logs ({file name: lines}; rank 0 writes, a full disk stops every rank)
    and pass metrics.jsonl and eval.jsonl lines to --logger."""
    run_folder.write_logs(Path(run.cfg.out_dir), records, run.rank)
    for name in ("eval.jsonl", "metrics.jsonl"):
        for record in records.get(name, []) if run.logger else []:
            run.logger.log(record)


def ranks_joined(parts: list[list[dict]]) -> list[dict]:
    """tokens.jsonl: one line per mini-batch, the columns of every rank's record of it concatenated."""
    return [{key: sum((r[key] for r in same), []) if isinstance(same[0][key], list) else value
             for key, value in same[0].items()} for same in zip(*parts)]


def say(run: Run, message: str, warning: bool = False) -> None:
    """A line on rank 0's console, above the progress bar (warnings on stderr)."""
    if run.rank == 0:
        tqdm.write(f"train.py: warning: {message}" if warning else message, file=sys.stderr if warning else None)


def warn_if_no_gradient(run: Run, metrics: dict) -> None:
    """Every group of the step had equal rewards: the policy gradient was zero; say why and what helps."""
    if metrics["adv/zero_frac"] == 1.0:
        acc, step = metrics["reward/acc"], metrics["step"]
        no_update = " and no update was made" if metrics["updates"] == 0 else ""
        say(run, f"step {step}: every response was right, so the policy gradient is zero{no_update}; use harder "
            f"data" if acc == 1 else f"step {step}: in every group the {run.cfg.group_size} responses had equal "
            f"rewards (train_acc {acc:.2f}), so the policy gradient is zero{no_update}; use easier data, a larger "
            f"--group-size or a higher --temperature", warning=True)


def eval_due(run: Run, done: int) -> bool:
    """Whether the held-out set is evaluated after `done` steps: before training, every --eval-every steps and
    after the last one (when there is a held-out set)."""
    cfg = run.cfg
    return bool(run.test_rows and cfg.eval_samples) and (
        done in (0, cfg.steps) or bool(cfg.eval_every and done % cfg.eval_every == 0))


def run_eval(run: Run, done: int) -> bool:
    """Evaluate the held-out set after `done` steps and write eval.jsonl; False when a stop signal came during it
    (nothing is written: the resume evaluates again)."""
    result, samples = evaluate(run, done)
    if result is None:
        return False
    write(run, {"eval.jsonl": [{"step": done, **result}],
                "samples.jsonl": gather(samples)[:run.cfg.samples_per_step]})
    when = f"after {plural(done, 'step')}" if done else "before training"
    say(run, f"held-out accuracy {when}: {result['eval/acc']:.4f} = {100 * result['eval/acc']:.2f}% as eval.py "
        f"reports it ({int(result['eval/n'])} samples)")
    return True


def evaluate(run: Run, done: int) -> tuple[dict | None, list[dict]]:
    """Mean accuracy over --eval-samples samples per held-out problem after `done` steps, and this rank's
    samples.jsonl records; (None, []) when a stop signal came during it. Each problem is one generate call seeded by
    the problem (data.problem_seed of --seed + 1 and its index) and the ranks hold consecutive shares, so the
    results and the records (gathered in rank order) are the same on any number of processes."""
    cfg, prompts = run.cfg, run.test_prompts
    rank_rows = list(range(len(prompts) * run.rank // run.world, len(prompts) * (run.rank + 1) // run.world))
    correct = total = length = 0.0
    samples = []
    run.policy.eval()
    with run.engine.ready(run.policy):  # a collective: every rank enters, also one without held-out problems
        out = run.engine.sample([prompts[i] for i in rank_rows], cfg.eval_samples,
                                [problem_seed(cfg.seed + 1, i) for i in rank_rows], 1, cfg.max_response_len,
                                cfg.temperature, cfg.top_p) if rank_rows else None
    if run.preemption.agreed():  # a stop signal came during it
        return None, []
    if rank_rows:
        texts = out.texts(run.tokenizer)
        verdicts = [float(reward.correct(t, run.test_rows[rank_rows[j // cfg.eval_samples]]["answer"], cfg.reward))
                    for j, t in enumerate(texts)]
        correct, total, length = sum(verdicts), len(texts), float(out.response_mask.sum())
        samples = completions(run, done, "heldout", texts, verdicts, rank_rows, cfg.eval_samples)
    S = cfg.eval_samples
    per_problem = [(row, int(sum(verdicts[j * S:(j + 1) * S]))) for j, row in enumerate(rank_rows)] if rank_rows else []
    correct, total, length = all_sum(correct, total, length)
    return {"eval/acc": correct / max(total, 1), "eval/len_mean": length / max(total, 1), "eval/n": total,
            "eval/correct": [n for _, n in sorted(gather(per_problem))]}, samples  # correct samples per problem


def checkpoint(run: Run, done: int) -> int:
    """Write the checkpoint after `done` steps (every rank; run_folder.save_checkpoint); returns `done`."""
    cfg = run.cfg
    run_folder.save_checkpoint(Path(cfg.out_dir), done, run.policy, run.optimizer, run.scheduler,
                               run_folder.recipe(asdict(cfg)), cfg.save_optimizer, cfg.keep_checkpoints, run.rank,
                               run.world)
    return done


def stop(run: Run, done: int, saved: int, where: str) -> int:
    """A stop signal ended the run after `done` steps: the checkpoint (unless the last one is of `done` steps; one
    that cannot be written, a full disk, is a warning: the previous one stays), then `stopped`; returns
    run_folder.STOPPED."""
    if saved != done:
        try:
            saved = checkpoint(run, done)
        except run_folder.RunError as e:
            run_folder.say(str(e), run.rank, warning=True)
    if run.rank == 0 and run.logger:
        run.logger.close()
    return stopped(run.cfg, run.rank, run.preemption, saved, where, done)


def stopped(cfg: Config, rank: int, preemption: run_folder.Preemption, saved: int, where: str,
            done: int | None = None) -> int:
    """OUT/stopped.json and the one line of a run stopped by a signal after `done` steps (default: `saved`), with the
    checkpoint of `saved` steps (0: none); returns run_folder.STOPPED."""
    done = saved if done is None else done
    if rank == 0:
        run_folder.write_stopped(Path(cfg.out_dir), preemption.signal, saved or None)
    kept = (f"checkpoint/step_{saved} is kept; the same command with --resume auto (or python train.py --resume "
            f"{cfg.out_dir}) continues the run" if saved else
            "nothing to keep; the same command with --resume auto (or --overwrite) starts it again")
    run_folder.say(f"stopped by {preemption.signal} {where}, {plural(done, 'step')} of {cfg.steps} done, "
                   f"{time.monotonic() - preemption.received:.1f} s after the signal: {kept}", rank)
    return run_folder.STOPPED


def leave_at_deadline(cfg: Config, rank: int, preemption: run_folder.Preemption) -> None:
    """--stop-deadline-s passed since a stop signal and the ranks have not stopped together: leave now (the watchdog
    thread of run_folder.Preemption), with stopped.json (rank 0) naming the newest complete checkpoint, one line on
    every rank (the frozen one may be rank 0), exit status run_folder.STOPPED."""
    out, kept = Path(cfg.out_dir), run_folder.complete_steps(Path(cfg.out_dir))
    if rank == 0:
        run_folder.write_stopped(out, preemption.signal or "a stop signal", kept[0] if kept else None)
    then = (f"checkpoint/step_{kept[0]} is kept; the same command with --resume auto continues from it" if kept else
            "no checkpoint was kept; the same command with --resume auto starts the run again")
    print(f"train.py: warning: rank {rank}: {preemption.signal or 'a stop signal'} came {cfg.stop_deadline_s:g} s ago "
          f"(--stop-deadline-s) and the ranks have not stopped together (a rank frozen, or its network down?): leaving "
          f"without a checkpoint of this stop; {then}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(run_folder.STOPPED)


def finish(run: Run) -> None:
    """After the last step: the export (unless up to date), the figures, and the closing lines (what the mask
    silenced, RQ1's correlations, a divergence, what the run wrote)."""
    cfg, out = run.cfg, Path(run.cfg.out_dir)
    if cfg.export_hf and run_folder.export_step(out / "hf") != cfg.steps:
        run_folder.export(run.policy, run.tokenizer, out, cfg.steps, compute_dtype(cfg, run.device), run.rank)
    if run.rank != 0:
        return
    if run.logger:
        run.logger.close()
    if cfg.plots:
        plots.figures([str(out)], str(out / "metrics.png"))
    shown = [n for n in ("spurious.jsonl", "s2t.png", "gradient.png") if (out / n).exists()]
    steps = plots.read_log(out / "metrics.jsonl")  # resumed steps included
    say(run, silenced_summary(cfg.algo, steps, shown))
    if plots.correlation_line(str(out)):  # RQ1: the gradient norm against p and H (gradient.png)
        say(run, plots.correlation_line(str(out)))
    diverged = divergence(steps)
    if diverged:
        say(run, diverged + "; lower --lr (or raise --warmup-steps)", warning=True)
    made = [name for name in run_folder.RUN_FILES if (out / name).is_file() and name != "stopped.json"]
    if not plots.read_log(out / "eval.jsonl"):  # no accuracy before and after: say why and how to get it
        say(run, "no held-out evaluation: " + ("--eval-samples 0" if not cfg.eval_samples else
            f"no held-out rows (--heldout N keeps N rows of {cfg.data} out of training)"))
    kept = run_folder.complete_steps(out)
    made += [f"checkpoint/step_{kept[0]}"] if kept else []
    made += [f"hf/ (python eval.py --run {out})"] if cfg.export_hf else []
    say(run, f"outputs in {out}/: {', '.join(made)}; " + (f"{diverged}; " if diverged else "")
        + f"continue with python train.py --resume {out} --steps N")


def silenced_summary(algo: str, steps: list[dict], files: list[str]) -> str:
    """The console line that counts what the mask silenced over a run (its metrics.jsonl lines)."""
    silenced = [int(m.get("s2t/silenced", 0)) for m in steps]
    candidates = sum(int(m.get("s2t/candidates", 0)) for m in steps)
    return (f"{algo} silenced {sum(silenced)} tokens in {sum(n > 0 for n in silenced)} of {len(steps)} steps; S2T "
            f"candidates (A > 0, p < tau_p): {candidates} (metrics.jsonl s2t/*{'; see ' if files else ''}"
            f"{', '.join(files)})")


def divergence(steps: list[dict]) -> str:
    """'' or the sentence that says which steps (metrics.jsonl lines) skipped an update for a non-finite gradient."""
    bad = [m["step"] for m in steps if m.get("skipped/nonfinite", 0) > 0]
    if not bad:
        return ""
    no_update = [m["step"] for m in steps if m.get("skipped/nonfinite", 0) > 0 and m.get("updates", 0) == 0]
    return (f"the run diverged: the gradient norm was not finite in {plural(len(bad), 'step')} of {len(steps)} "
            f"({_step_list(bad)}), {len(no_update)} of them made no update at all")


def _step_list(numbers: list[int]) -> str:
    """[2, 3, 4, 7] -> 'steps 2-4, 7'."""
    runs, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            runs.append(f"{start}-{n}" if n > start else f"{n}")
            start = None
    return ("steps " if len(numbers) > 1 else "step ") + ", ".join(runs)


def plural(n: int, noun: str) -> str:
    """'1 step', '3 steps'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")



# ------------------------------------------------ data positions and the rollout engine
def prompt_indices(position: int, n_rows: int, cfg: Config) -> list[int]:
    """Training rows of the --prompts-per-step prompts of the step after `position` steps (all ranks): a fresh
    permutation of the rows every epoch."""
    perms, out = {}, []
    for pos in range(position * cfg.prompts_per_step, (position + 1) * cfg.prompts_per_step):
        epoch, i = divmod(pos, n_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
        out.append(int(perms[epoch][i]))
    return out


def rank_slice(n: int, cfg: Config, rank: int, world: int) -> list[int]:
    """Positions (0..n-1 in the step's prompt list) this rank handles: the rank-th slice of every mini-batch, so a
    mini-batch is the same set of prompts for any number of ranks (difference 4)."""
    m = cfg.mini_batch_prompts // world
    return [k * cfg.mini_batch_prompts + rank * m + j for k in range(n // cfg.mini_batch_prompts) for j in range(m)]


def prompts_per_call(cfg: Config, n: int, lm_config, dtype_bytes: int) -> int:
    """Prompts per generate call for n prompts on a rank: --rollout-chunk, or the most whose worst-case KV cache
    (G rows x (max prompt + response) tokens each) fits --kv-cache-gb."""
    per_prompt = kv_cache_bytes(lm_config, cfg.group_size, cfg.max_prompt_len + cfg.max_response_len, dtype_bytes)
    return min(n, cfg.rollout_chunk or max(1, int(cfg.kv_cache_gb * 1e9 // per_prompt)))


def compute_dtype(cfg: Config, device) -> torch.dtype:
    """FSDP2's compute dtype (bf16 with mixed precision on CUDA, else fp32): the sampler's weights and KV cache, and
    the exported model's."""
    return torch.bfloat16 if device.type == "cuda" and cfg.mixed_precision else torch.float32


def rollout_engine(cfg: Config, lm, tokenizer, prompts: list[list[int]], rank: int, world: int, device,
                   stop=None):
    """The --rollout engine (rollout.make_engine), made once (vllm: on every rank at the same time), sized for the
    longest of `prompts`; prints its KV-cache budget. stop: the plain sampler's early end (a stop signal)."""
    n, G, dtype = cfg.prompts_per_step // world, cfg.group_size, compute_dtype(cfg, device)
    chunk, tokens = prompts_per_call(cfg, n, lm.config, dtype.itemsize), cfg.max_prompt_len + cfg.max_response_len
    kv_call = kv_cache_bytes(lm.config, chunk * G, tokens, dtype.itemsize)
    kv_vllm = min(kv_cache_bytes(lm.config, n * G, tokens, dtype.itemsize), int(cfg.kv_cache_gb * 1e9))
    if rank == 0:
        what = (f"vLLM KV cache {kv_vllm / 2**30:.2f} GiB" if cfg.rollout == "vllm" else
                f"{chunk} prompts x G {G} per generate call, KV cache at most {kv_call / 2**30:.2f} GiB")
        print(f"rollout ({cfg.rollout}): {what} per rank (--kv-cache-gb {cfg.kv_cache_gb:g} = "
              f"{cfg.kv_cache_gb * 1e9 / 2**30:.2f} GiB)", flush=True)
    longest = max(map(len, prompts)) + cfg.max_response_len  # train and held-out prompts
    return rollout.make_engine(cfg.rollout, lm, tokenizer, cfg.chat, stop, max_model_len=longest,
                               kv_cache_memory_bytes=kv_vllm, dtype=dtype, seed=cfg.seed,
                               captured=cfg.cuda_graphs and device.type == "cuda")



# ------------------------------------------------------------------------------------------------- setup
def read_inputs(cfg: Config, world: int) -> tuple[list[dict], list[dict]]:
    """The checks that need neither the model nor the run folder, made first (every rank): the number of processes,
    the logger, the data -> (training rows, held-out rows) of data.load_rows."""
    if cfg.prompts_per_step % world or cfg.mini_batch_prompts % world:
        raise ValueError(f"--prompts-per-step and --mini-batch-prompts must be multiples of the {world} ranks")
    run_folder.check_logger(cfg.logger)
    train_rows, test_rows, repeated = load_rows(cfg)
    if repeated and dist.get_rank() == 0:
        print(f"train.py: note: {repeated_note(cfg.data, repeated, len(train_rows) + len(test_rows))}",
              file=sys.stderr, flush=True)
    too_few(cfg, len(train_rows))
    return train_rows, test_rows


def too_few(cfg: Config, n_rows: int) -> None:
    """A step takes each training problem at most once: refuse --prompts-per-step above the problems there are."""
    if cfg.prompts_per_step > n_rows:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is more than the {n_rows} training problems of "
                         f"{cfg.data or 'the built-in task'} (a step takes each at most once): lower it")


def setup(cfg: Config, rows: tuple[list[dict], list[dict]], rank: int, world: int, device,
          checkpoint: Path | None, preemption: run_folder.Preemption) -> Run:
    """The model, its sharding, the optimizer, the rollout engine, and the checkpoint a resume continues from."""
    if device.type == "cpu":
        keep_freed_memory()
        # Deterministic kernels: without them the backward on several threads sums in a varying order, so two
        # runs of one command at 2 threads, or a run and its resume, differ from the first update on
        # (docs/training.md, Reproducibility). CUDA keeps its fast kernels.
        torch.use_deterministic_algorithms(True, warn_only=True)
    train_rows, test_rows = rows
    # one process: read onto its device; several: read once on rank 0, the others build it on the meta device and
    # receive their shards of the weights from rank 0 in shard_policy (model.from_rank0)
    load = (lambda: load_model(cfg.model, device=device)) if world == 1 else (lambda: from_rank0(
        lambda: load_model(cfg.model)))
    lm, tokenizer = load()
    if cfg.chat and not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {cfg.model!r} has no chat template; use --no-chat")
    # A token spells at most `longest` characters, so a problem longer than max_prompt_len x longest characters has
    # more tokens than max_prompt_len: dropped before it is tokenized (a 20 MB row took 11 GB and 74 s to tokenize).
    longest = max(map(len, tokenizer.get_vocab()))

    def fitting(rows):  # rows whose prompt fits --max-prompt-len, their prompts, how many did not (difference 7)
        short = [r for r in rows if len(r["problem"]) <= cfg.max_prompt_len * longest]
        prompts = [rollout.format_prompt(tokenizer, r["problem"], cfg.chat, cfg.instruction) for r in short]
        keep = [i for i, p in enumerate(prompts) if len(p) <= cfg.max_prompt_len]
        return [short[i] for i in keep], [prompts[i] for i in keep], len(rows) - len(keep)

    train_rows, train_prompts, dropped = fitting(train_rows)
    test_rows, test_prompts, dropped_test = fitting(test_rows)
    if not train_prompts:
        raise ValueError(f"every prompt of {cfg.data or 'the built-in task'} is longer than --max-prompt-len")
    too_few(cfg, len(train_prompts))
    if (dropped or dropped_test) and rank == 0:
        print(f"train.py: dropped {dropped} of {dropped + len(train_prompts)} training prompts and {dropped_test} of "
              f"{dropped_test + len(test_prompts)} held-out prompts longer than --max-prompt-len {cfg.max_prompt_len} "
              f"tokens", file=sys.stderr, flush=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if rank == 0:  # the memory model's estimate for this run (docs/memory.md), rows at their longest
        per_rank, prompt_len = cfg.prompts_per_step // world, max(map(len, train_prompts))
        row, n_rows = prompt_len + cfg.max_response_len, cfg.mini_batch_prompts // world * cfg.group_size
        print(memory_line(memory_estimate(
            lm.config, world, min(max(cfg.max_tokens_per_micro_batch, row), n_rows * row), cfg.grad_checkpointing,
            prompts_per_call(cfg, per_rank, lm.config, compute_dtype(cfg, device).itemsize) * cfg.group_size,
            prompt_len, cfg.max_response_len,
            fsdp=cfg.fsdp, compute_bytes=2 if cfg.fsdp and cfg.mixed_precision else 4,  # as in effect (in_effect)
            chunk_size=cfg.chunk_size)), flush=True)

    def make_policy(model_lm):
        policy = Policy(model_lm, vocab_size=lm_vocab_size(tokenizer))  # the sampler's rows only
        if cfg.grad_checkpointing:
            model_lm.gradient_checkpointing_enable({"use_reentrant": False})
        if cfg.fsdp:  # in_effect: on with several processes or CUDA
            shard_policy(policy, mixed_precision=cfg.mixed_precision, from_rank0=world > 1, device=device)
        return policy

    policy = make_policy(lm)
    ref_policy = None
    if cfg.algo == "grpo" and cfg.kl_beta > 0:
        ref_policy = make_policy(load()[0]).requires_grad_(False)
    # fused: one kernel over all parameters (CPU: 4-5x faster than the foreach loop at SmolLM2's 135M, bench.py flops)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    # lr: linear warm-up over warmup_steps optimizer steps, then constant
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    start = 0
    if checkpoint is not None:  # any number of ranks: DCP reshards (run_folder.load_checkpoint)
        state = run_folder.load_checkpoint(checkpoint, policy, optimizer, scheduler)
        start = state["step"]
        run_folder.say(f"resuming from {checkpoint} at step {start + 1} ({plural(start, 'step')} done)", rank)
        if not state["optimizer"]:
            run_folder.say(f"{checkpoint} holds weights only (--no-save-optimizer): AdamW restarts from zero moments, "
                           f"so the resumed run differs from an uninterrupted one", rank, warning=True)
    engine = rollout_engine(cfg, lm, tokenizer, train_prompts + test_prompts, rank, world, device,
                            preemption.requested)  # the plain sampler stops at a signal
    logger = run_folder.open_logger(cfg.logger, Path(cfg.out_dir), asdict(cfg)) if rank == 0 else None
    return Run(cfg, rank, world, device, policy, ref_policy, tokenizer, optimizer, scheduler, engine, train_rows,
               train_prompts, test_rows, test_prompts, preemption, logger, start)


def keep_freed_memory() -> None:
    """Training on the CPU: keep freed memory in the process. glibc's malloc returns every freed block over 32 MB
    to the OS, so each micro-batch's activations and (V, D) gradients fault their pages in again (zeroed by the
    kernel): ~25-35% of the CPU default's update (docs/performance.md). No mmap'd blocks and no trimming keep them
    for reuse, as the jemalloc / tcmalloc setups recommended for PyTorch on CPUs do; the resident memory then stays
    at the run's peak. A no-op without glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    mallopt(M_MMAP_MAX, 0)  # every block from the heap, none mmap'd (and unmapped at its free)
    mallopt(M_TRIM_THRESHOLD, -1)  # (size_t) -1: never give the heap's free top back


# ------------------------------------------------------------------------------------------- distributed
def all_sum(*values: float) -> list[float]:
    """Sum python floats over ranks (one all-reduce)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_max(value: int) -> int:
    """The largest of one integer over ranks (the micro-batch count every rank makes)."""
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def all_gather_cat(values: torch.Tensor) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from all ranks (pad to the longest, all-gather, trim)."""
    world, values = dist.get_world_size(), values.detach().float().cpu()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()]))
    longest = int(max(sizes))
    parts = [torch.zeros(longest) for _ in range(world)]
    dist.all_gather(parts, torch.nn.functional.pad(values, (0, longest - values.numel())))
    return torch.cat([p[:int(s)] for p, s in zip(parts, sizes)])


def gather(records: list) -> list:
    """Every rank's list, concatenated in rank order (on every rank)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, records)
    return [x for part in parts for x in part]


def agree(work, *args):
    """work(*args) on every rank; a bad input on any rank raises on every rank (naming the rank unless all
    failed), so that rank 0 prints it once and no rank waits in a collective for one that failed."""
    try:
        result, failed = work(*args), None
    except BAD_INPUT as e:
        result, failed = None, e
    failed = run_folder.agreed_failure(failed)
    if failed:
        raise ValueError(failed)
    return result


# ---------------------------------------------------------------------------------- configuration and CLI
@dataclass
class Config:
    """RL-train a causal LM with STAPO or a baseline (defaults: with CUDA the paper's recipe, docs/paper.md §6;
    without CUDA the cpu preset, whose values the flags below name). Or, instead
    of training: `python train.py --plot RUN [RUN ...] [--out PNG]` redraws the figures of finished runs, overlaid
    (RUN/metrics.png and RUN/s2t.png for one run, FIRST_RUN/compare.png and compare_s2t.png for several; --out
    X.png: X.png and X_s2t.png)."""
    preset: str = "auto"
    """auto | paper | cpu: auto = paper with CUDA, cpu without; flags given on the command line override it"""
    model: str = "Qwen/Qwen3-1.7B-Base"
    """Hub id, local HF dir, .gguf file, 'smollm2' (packaged SmolLM2-135M-Instruct), 'tiny'/'tiny64' (random, tests)"""
    data: str = "BytedTsinghua-SIA/DAPO-Math-17k"
    """Hub dataset id or local .jsonl/.json/.parquet file; '' = the built-in arithmetic task"""
    split: str = "train"
    """dataset split (Hub ids)"""
    prompt_key: str = "prompt"
    """field of the problem text (a dotted path for nested fields; a chat message list uses its last user turn)"""
    answer_key: str = "reward_model.ground_truth"
    """field of the gold answer (dotted path); a string or a list of strings"""
    heldout: int | None = None
    """rows of --data kept out of training and evaluated before and after it; default (none): a tenth of the rows,
    at most 20, none below 10 rows (data.heldout_count); 0 = none. The built-in task has its own 20"""
    instruction: str = rollout.INSTRUCTION
    """text appended to every problem (default: the paper's \\boxed{} instruction, rollout.INSTRUCTION)"""
    chat: bool = True
    """format prompts with the tokenizer's chat template (--no-chat: raw text, e.g. for tiny models)"""
    algo: str = "stapo"
    """stapo | justrl | grpo | 20-entropy | fullmask | randmask | highmask (stapo.ALGORITHMS)"""
    steps: int = 500
    """rollout steps (each makes prompts_per_step / mini_batch_prompts optimizer steps)"""
    prompts_per_step: int = 256
    """prompts per rollout batch, over all ranks"""
    group_size: int = 8
    """G: responses sampled per prompt"""
    mini_batch_prompts: int = 64
    """prompts per optimizer step, over all ranks"""
    max_tokens_per_micro_batch: int = 32768
    """tokens per forward/backward on each rank, counted as its rows' prompt + response tokens (no padding, as
    verl's dynamic batch size): the rows of a prompt together, a longer row alone, 1 = one row at a time (gradient
    accumulation: changes memory, not the update)"""
    lr: float = 1e-6
    """AdamW learning rate, constant after the warm-up"""
    warmup_steps: int = 10
    """optimizer steps of linear learning-rate warm-up"""
    weight_decay: float = 0.1
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max global gradient norm"""
    clip_low: float | None = None
    """eps_low of the ratio clip; default: the algorithm's (stapo.ALGORITHMS, 0.2)"""
    clip_high: float | None = None
    """eps_high of the ratio clip; default: the algorithm's (0.28; GRPO 0.2)"""
    dual_clip: float | None = 10.0
    """dual clip constant c > 1 for A < 0 (veRL's clip_ratio_c, 10 in the paper's JustRL scripts); none = off"""
    tau_p: float = 0.002
    """S2T probability threshold"""
    quantile: float = 0.75
    """S2T entropy quantile q over the candidates of the mini-batch"""
    kl_beta: float = 0.0
    """GRPO only: weight of the k3 KL to the initial model (0 = no reference model)"""
    reward: str = "dapo"
    """dapo (+1/-1 by reward.grade), binary (1/0), strict (normalized last-box string match), or your own function
    FILE.py:FUNCTION or MODULE:FUNCTION, called as FUNCTION(response, answer) -> a finite number (reward.py, "your own
    reward"; examples/reward_last_line.py); a positive reward counts as correct (reward/acc, held-out accuracy)"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are dropped"""
    max_response_len: int = 15360
    """max new tokens per response"""
    temperature: float = 1.0
    """sampling temperature (also divides the logits of the training forward)"""
    top_p: float = 1.0
    """nucleus sampling"""
    rollout: Literal["auto", "plain", "vllm"] = "auto"
    """auto | plain | vllm: rollout engine (vllm: a colocated vLLM engine fed with the policy's weights;
    docs/rollouts.md); auto = vllm on CUDA when vllm is installed, else plain (config.json records which)"""
    kv_cache_gb: float = 40.0
    """KV-cache budget per rank in GB (worst case: every row at max prompt + response length): bounds the plain
    sampler's prompts per generate call (--rollout-chunk 0) and is vLLM's KV cache (at most what the rollout needs)"""
    rollout_chunk: int = 0
    """prompts per generate call on each rank (0 = the most that fit --kv-cache-gb); 1 makes rollouts independent of
    the number of ranks"""
    cuda_graphs: bool = False
    """--rollout plain on CUDA: decode through one CUDA graph per batch bucket (rollout.CapturedStep); off until a GPU
    run of `python bench.py gpu` has checked it (docs/gpu.md)"""
    collective_timeout_min: float = 60.0
    """minutes a rank waits in a collective for the others before the run fails (ranks whose rollouts are longer
    finish later; NCCL's default is 10)"""
    stop_deadline_s: float = 240.0
    """seconds from a stop signal after which a rank that has not stopped (a frozen rank holds the others) leaves with
    exit status 75, keeping the last complete checkpoint; under the job's grace period (SLURM
    --signal=USR1@300: 300), above a checkpoint write; 0 = wait for every rank"""
    tis_cap: float | None = None
    """truncated importance sampling: weight tokens by min(pi_old / pi_sampler, cap) (e.g. 2 with --rollout vllm);
    default off"""
    chunk_size: int = 1024
    """tokens per LM-head chunk in the log-prob/entropy pass"""
    fsdp: bool = False
    """shard with FSDP2 also on one CPU process (always on with several processes or on CUDA; config.json records
    whether the model was sharded)"""
    mixed_precision: bool = True
    """bf16 compute with fp32 master weights and gradient reduction (CUDA only; config.json records false without
    CUDA)"""
    grad_checkpointing: bool = True
    """recompute each decoder layer's activations in the backward: per token it keeps each layer's input instead of
    all its activations (Qwen3-1.7B: 13x less activation memory), for ~1/3 more update compute"""
    eval_every: int = 0
    """evaluate the held-out problems every N steps (0 = before and after training only, when there are any)"""
    eval_samples: int = 4
    """samples per held-out problem (at --temperature); 0 = no held-out evaluation"""
    entropy_change: bool = False
    """after each optimizer step, a no-grad forward over the same mini-batch: log the mean entropy change at silenced
    tokens, kept candidates and other tokens (entropy_change/* in metrics.jsonl; one more forward per update), and
    the logit-gradient norm, tokens and entropy change per kind of token and part of the response (shares/*)"""
    spurious_per_step: int = 20
    """silenced tokens written to OUT/spurious.jsonl per step"""
    samples_per_step: int = 4
    """completions (prompt, response, reward) written to OUT/samples.jsonl per step and per held-out evaluation"""
    token_sample: int = 128
    """response tokens per mini-batch and rank drawn into OUT/tokens.jsonl for the S2T figure: every candidate and
    silenced token (at most this many) plus this many others at random (0 = none)"""
    seed: int = 0
    """seed of data order, sampling and initialization"""
    out_dir: str = "out/train"
    """output folder: config.json, metrics.jsonl, eval.jsonl, samples.jsonl, spurious.jsonl, tokens.jsonl,
    checkpoint/, hf/, metrics.png, s2t.png"""
    save_every: int = 50
    """also write a sharded checkpoint every N steps (0 = only at the last step, which always writes one, so every
    finished run can be resumed)"""
    keep_checkpoints: int = 2
    """complete checkpoints kept (the newest; 2 leaves one to fall back to if the newest is found damaged)"""
    save_optimizer: bool = True
    """keep AdamW's moments in checkpoints (--no-save-optimizer: weights only, ~1/3 of the size; a resume then
    restarts AdamW from zero moments, with a warning)"""
    resume: str = ""
    """RUN: continue the run in the folder RUN from its newest verified checkpoint, with its config (only the flags of
    run_folder.RESUMABLE may change; a change is recorded in RUN/resumes.jsonl); auto: continue the run in --out-dir
    if it holds a checkpoint, else start it there with the flags given (the same command line for the first attempt
    and every requeue or restart)"""
    overwrite: bool = False
    """replace the run already in --out-dir: its logs, checkpoints and export are deleted when training starts
    (without it, a folder that holds a run is refused)"""
    export_hf: bool = True
    """write a Hugging Face-format model to OUT/hf at the end"""
    plots: bool = True
    """write this run's figures OUT/metrics.png, s2t.png and gradient.png at its end (needs matplotlib; --plot RUN
    [RUN ...], not this flag, redraws and overlays finished runs)"""
    logger: str = ""
    """live curves of the metrics.jsonl and eval.jsonl keys: '' (none), tensorboard (OUT/tensorboard; pip install
    tensorboard) or wandb (pip install wandb; WANDB_MODE=offline works without network)"""


# The embedded default for machines without a GPU (`--preset cpu`): SmolLM2-135M-Instruct on builtin_task, sized so
# `python train.py` (8 min) and `torchrun --standalone --nproc_per_node=2 train.py` (9.5 min) finish in < 15
# minutes on 2 idle cores, and S2T silences tokens in most steps (docs/training.md).
CPU_PRESET = dict(
    model="smollm2", data="", chat=False, instruction="The answer is", temperature=1.0, max_response_len=24,
    steps=10, prompts_per_step=16, mini_batch_prompts=8, lr=3.5e-6, warmup_steps=0, grad_checkpointing=False,
    rollout_chunk=0, save_every=0, keep_checkpoints=1, eval_samples=4, out_dir="out/train-cpu",
)


def parse_config(argv: list[str] | None = None) -> tuple[Config, dict | None, list[str]]:
    """argv -> (Config, the resumed run's recorded config or None for a new run, warnings for rank 0 to print).
    Each field is a --flag (cli.parse_flags: underscores -> dashes, the string under it is its --help). Values: the
    flags given, else (resuming) the run's config.json, else the preset's (CPU_PRESET or Config). Every value is
    checked here; the run folder is only read (its config.json and which checkpoints it holds)."""
    given = cli.parse_flags(Config, argv, "train.py", notes={k: f"cpu preset: {v!r}" for k, v in CPU_PRESET.items()},
                        modes={"plot": plots.PLOT_HELP})  # --plot: main hands over to plots.main before this
    cuda = torch.cuda.is_available()
    preset = given.get("preset", "auto")
    if preset == "auto":
        preset = "paper" if cuda else "cpu"
    if preset not in ("paper", "cpu"):
        raise ValueError(f"unknown --preset {preset!r}; valid: auto, paper, cpu")
    defaults = CPU_PRESET if preset == "cpu" else {}
    resume = given.get("resume", "")
    if resume and given.get("overwrite"):
        raise ValueError("--overwrite starts a new run in --out-dir; it cannot be combined with --resume")
    if resume not in ("", "auto"):  # --resume RUN: the run in its own folder
        if "out_dir" in given and Path(given["out_dir"]) != Path(resume):
            raise ValueError(f"--resume continues the run in its own folder {resume}; --out-dir cannot move it")
        given["out_dir"] = resume
    out = given.get("out_dir", defaults.get("out_dir", Config.out_dir))
    if not out.strip():  # Path("") is the working directory
        raise ValueError("--out-dir '' names no folder: give one, e.g. --out-dir out/run")
    if any(ord(c) < 32 or ord(c) == 127 for c in out):  # a newline would split every console line that names it
        raise ValueError(f"--out-dir {out!r} holds a control character: name the folder without one")
    out = Path(out)
    recorded = None  # --resume RUN, or --resume auto in a folder with a complete checkpoint: the run's recipe
    if resume and (resume != "auto" or run_folder.complete_steps(out)):
        recorded = cli.check_values(Config, run_folder.recorded_config(out), str(out / "config.json"))  # hand edits too
        if not run_folder.complete_steps(out):
            raise FileNotFoundError(f"{out} has no checkpoint to resume from: the run stopped before its first one "
                                    f"(written every --save-every steps, at a stop by signal and at the last step); "
                                    f"start it again with {run_folder.again(out)} (or replace it with --overwrite)")
    cfg = Config(**({**recorded, **given} if recorded else {**defaults, **given, "preset": preset}))
    reward.load_reward(cfg.reward)  # an unknown mode or a broken FILE.py:FUNCTION: one line now, not in step 1
    if cfg.algo not in stapo.ALGORITHMS:
        raise ValueError(f"unknown --algo {cfg.algo!r}; valid: {', '.join(stapo.ALGORITHMS)}")
    for name, low in _AT_LEAST.items():
        if getattr(cfg, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(cfg, name)})")
    if cfg.temperature <= 0:
        raise ValueError("--temperature must be > 0 (the training forward divides the logits by it)")
    for name, ok, rule in (("top_p", 0 < cfg.top_p <= 1, "in (0, 1]"), ("tau_p", 0 < cfg.tau_p <= 1, "in (0, 1]"),
                           ("quantile", 0 <= cfg.quantile <= 1, "in [0, 1]"), ("grad_clip", cfg.grad_clip > 0, "> 0"),
                           ("dual_clip", cfg.dual_clip is None or cfg.dual_clip > 1, "> 1"),
                           ("kv_cache_gb", cfg.kv_cache_gb > 0, "> 0"),
                           ("heldout", cfg.heldout is None or cfg.heldout >= 0, ">= 0"),
                           ("collective_timeout_min", cfg.collective_timeout_min > 0, "> 0"),
                           ("tis_cap", cfg.tis_cap is None or cfg.tis_cap > 0, "> 0")):
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')} must be {rule} (got {getattr(cfg, name)})")
    if cfg.prompts_per_step % cfg.mini_batch_prompts:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is not a multiple of --mini-batch-prompts "
                         f"{cfg.mini_batch_prompts}")
    for f in fields(Config):  # a float flag must be a finite float32 (AdamW computes in float32: --lr 1e39 overflows)
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= torch.finfo(torch.float32).max):
            raise ValueError(f"--{f.name.replace('_', '-')} {value} is not a finite float32")
    # torchrun's env:// contract: WORLD_SIZE is set before the process group exists
    cfg, notes = in_effect(cfg, given, cuda, int(os.environ.get("WORLD_SIZE", 1)))
    if recorded:
        run_folder.resume_changes(recorded, asdict(cfg))  # raises for a change of recipe
    try:  # rank 0 writes into it; every rank writes its checkpoint shards
        cli.check_writable("--out-dir", out)
    except OSError:
        if not (recorded and run_folder.finished_read_only(out, asdict(cfg))):
            raise
    return cfg, recorded, notes


# Lower bounds of the integer (and a few float) flags, checked before anything loads.
_AT_LEAST = dict(steps=1, prompts_per_step=1, group_size=2, mini_batch_prompts=1, max_tokens_per_micro_batch=1,
                 lr=0, warmup_steps=0, weight_decay=0, kl_beta=0, max_prompt_len=1, max_response_len=1, rollout_chunk=0,
                 chunk_size=1, eval_every=0, eval_samples=0, spurious_per_step=0, samples_per_step=0,
                 save_every=0, keep_checkpoints=1)


def in_effect(cfg: Config, given: dict, cuda: bool, world: int) -> tuple[Config, list[str]]:
    """The config the run actually uses, which config.json records, and the lines for rank 0 to print: a warning for
    each flag given on the command line that has no effect on this machine or with these settings (stored as in
    effect), a note where --rollout auto could not choose vLLM on CUDA."""
    notes, rollout_engine = [], cfg.rollout
    if cfg.rollout == "auto":  # vLLM where it pays (CUDA) and is installed
        rollout_engine = "vllm" if cuda and importlib.util.find_spec("vllm") is not None else "plain"
        if cuda and rollout_engine == "plain":
            notes.append("note: --rollout auto samples with the plain sampler, since vllm is not installed (pip "
                         "install vllm==0.32.0: far faster at the paper's lengths; docs/rollouts.md)")
    effective = {"rollout": rollout_engine,
                 "fsdp": cfg.fsdp or world > 1 or cuda, "mixed_precision": cfg.mixed_precision and cuda,
                 "kl_beta": cfg.kl_beta if cfg.algo == "grpo" else 0.0, "heldout": cfg.heldout if cfg.data else 0,
                 "eval_every": cfg.eval_every if (not cfg.data or cfg.heldout != 0) and cfg.eval_samples else 0}
    why = {"mixed_precision": "without CUDA (compute is fp32)", "kl_beta": f"with --algo {cfg.algo} (GRPO only)",
           "heldout": "with the built-in task (it has its own 20 held-out problems)",
           "eval_every": "without a held-out evaluation (--heldout 0 or --eval-samples 0)"}
    for name, reason in why.items():
        if name in given and given[name] != effective[name]:
            notes.append(f"warning: --{name.replace('_', '-')} {given[name]} has no effect {reason}; config.json "
                         f"records {name} = {effective[name]!r}")
    return replace(cfg, **effective), notes


# one line and exit status 2: bad inputs, a full disk, a folder in use, an error raised by your --reward function
BAD_INPUT = (FileNotFoundError, ValueError, KeyError, ImportError, OSError, run_folder.RunError, reward.RewardError)


def main(argv: list[str] | None = None) -> int:
    """`python train.py [flags]`: exit status 0 (trained, or nothing left to do), 2 (a bad input or a full disk:
    one line), run_folder.STOPPED (a stop signal: a checkpoint was written, run the same command again)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--plot" in argv:  # python train.py --plot RUN [RUN ...] [--out PNG]: figures only (plots.py)
        return plots.main(argv)
    rank = int(os.environ.get("RANK", 0))  # until the process group exists: torchrun's env:// contract
    run = lock = None
    with run_folder.Preemption() as preemption:  # from here on, SIGTERM / SIGUSR1 stop the run with a checkpoint
        try:
            cfg, recorded, notes = parse_config(argv)
            rank, world, device = init_distributed(cfg.collective_timeout_min)
            for note in notes if rank == 0 else ():
                print(f"train.py: {note}", file=sys.stderr, flush=True)
            rows = agree(read_inputs, cfg, world)  # the inputs before the folder
            opened = run_folder.open_run(asdict(cfg), recorded, rank, world)
            if opened is None:
                run_folder.say(f"{cfg.out_dir} has done its {plural(cfg.steps, 'step')}" + (
                    " and its export is up to date" if cfg.export_hf else "") + ": nothing to do", rank)
                return 0
            start, checkpoint_path, lock = opened
            if cfg.stop_deadline_s:
                preemption.arm(cfg.stop_deadline_s, lambda: leave_at_deadline(cfg, rank, preemption))
            if preemption.agreed():  # a stop signal during startup: stop before the model loads
                return stopped(cfg, rank, preemption, start, "during startup")
            run = setup(cfg, rows, rank, world, device, checkpoint_path, preemption)
            return train(run)
        except BAD_INPUT as e:
            return cli.error("train.py", e, rank)
        finally:
            if run is not None:
                run.engine.close()  # the rollout engine; deleting a vLLM engine may already tear down the group
            if lock is not None:
                lock.release()
            if dist.is_initialized():
                dist.destroy_process_group()



if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown. FSDP's DTensors keep torch's process group alive past
    # destroy_process_group, and when a gloo worker thread is still releasing the last collective's tensors as Python
    # finalizes, it aborts the finished run ("terminate called without an active exception", ~1 run in 20 on CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
