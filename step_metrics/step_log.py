"""A step's metrics (docs/outputs.md, Metrics glossary): `StepLog` watches the step through the seam
(step_metrics/watch.py), keeps this rank's sums over sequences and tokens and reduces them over
ranks once, in `result`, into the metrics.jsonl line, with the step's spurious.jsonl, samples.jsonl
and tokens.jsonl records (`StepResult`). It reads the step's own decisions (the mask, tau_h, N):
it never recomputes them. --gradient-share and --entropy-change ride on it (`Probes`)."""
from __future__ import annotations

import math
import time
import warnings
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

import reward
import s2t
import stapo
from distributed.process_group import all_gather_cat, all_sum
from step_metrics import s2t_diagnostics
from step_metrics.watch import Watch

if TYPE_CHECKING:
    from model import TokenStats
    from rollout import Rollout


class StepResult(NamedTuple):
    """What a step writes: its metrics.jsonl line and its lines of spurious.jsonl, samples.jsonl and
    tokens.jsonl."""
    metrics: dict
    spurious: list[dict]
    samples: list[dict]
    tokens: list[dict]


class Probes(NamedTuple):
    """What the metrics ask of the run beside the step's decisions (train.py makes them):
    samples(texts, rewards, prompt_rows): samples.jsonl records (`completions`);
    gradient(mb, weights, N): accumulate a gradient with other token weights (--gradient-share);
    stats(rollout): p, H, collision of the current policy (--entropy-change);
    parameters(): the policy's parameters (their .grad)."""
    samples: Callable
    gradient: Callable
    stats: Callable
    parameters: Callable


ENTROPY_KINDS = ("silenced", "candidate", "other")  # s2t_diagnostics.entropy_change's token kinds
# s2t_diagnostics.token_cells' keys
CELLS = tuple(f"{kind}_{part}" for kind in s2t_diagnostics.TOKEN_KINDS
              for part in s2t_diagnostics.PARTS)


def on_policy_rule(pi_theta: TokenStats, mb, cfg) -> torch.Tensor:
    """(b, T) bool: what S2T's rule silences in a mini-batch whose p and H only its update's forward
    gave (on policy: stapo.token_weights could not apply it), pooling the --quantile-window, whose
    state then only this metric reads; the mini-batch's candidates then join it."""
    window = mb.context.window
    rule, _ = s2t.spurious_mask(pi_theta.logprobs, pi_theta.entropy, mb.advantages, mb.mask,
                                cfg.tau_p, cfg.quantile, all_gather_cat,
                                None if window is None else window.values)
    if window is not None:
        cand = s2t.candidates(pi_theta.logprobs, mb.advantages, mb.mask, cfg.tau_p)  # (b, T)
        window.add(all_gather_cat(pi_theta.entropy.detach()[cand]))
    return rule


def graded_tokens(batch: Rollout, tokenizer, mode: str) -> torch.Tensor:
    """(B, T) bool: each response's graded part (reward.graded_count), the rest of it being the text
    after the answer."""
    graded = torch.zeros(batch.response_ids.shape, dtype=torch.bool)
    for i, (ids, mask) in enumerate(zip(batch.response_ids, batch.response_mask)):
        graded[i, :reward.graded_count(tokenizer, ids[mask.bool()].tolist(), mode)] = True
    return graded


class StepLog(Watch):
    """The metric bookkeeping of one step, a `Watch`: sums over this rank's sequences and tokens,
    reduced over ranks once, in `result`, into the metrics.jsonl line (docs/outputs.md, Metrics
    glossary), and the step's spurious.jsonl, samples.jsonl and tokens.jsonl records. Made at the
    start of the step (its rollout time counts from then)."""

    def __init__(self, cfg, step: int, rank: int, tokenizer, probes: Probes):
        self.cfg, self.step, self.rank, self.tokenizer, self.probes = cfg, step, rank, tokenizer, \
            probes
        self.t0, self.t_rollout = time.time(), 0.0
        self.sums = dict.fromkeys(["entropy", "logprob_diff", "candidates", "silenced", "kept",
                                   "rule_silenced", "silenced_p", "silenced_h", "gn_silenced",
                                   "gn_kept", "loss/policy", "loss/kl", "loss_tokens",
                                   *stapo.CLIP_STATS, "computed_tokens", "attention_cells",
                                   "real_tokens"], 0.0)
        self.sums |= dict.fromkeys([f"entropy_change/{kind}_{x}" for kind in ENTROPY_KINDS
                                    for x in ("sum", "n")], 0.0)
        # equal on every rank
        self.counts = {"updates": 0, "skipped/zero_adv": 0, "skipped/nonfinite": 0}
        if cfg.gradient_share:
            self.counts["grad_share/n"] = 0
        # summed norms, global (gradient_share)
        self.grad_share = {"all": 0.0, "candidates": 0.0, "without": 0.0}
        self.grad_norm_sum, self.part, self.update = 0.0, None, None
        self.spurious, self.samples, self.tokens = [], [], []

    def rolled_out(self, batch: Rollout, texts, prompt_rows, rewards, advantages,
                   pi_old: TokenStats) -> None:
        """The rollout's counts, its samples.jsonl records, and pi_old (read in `result`: on policy
        the update's forward fills it in)."""
        self.t_rollout, self.t0 = time.time() - self.t0, time.time()
        self.batch, self.pi_old = batch, pi_old
        mask = batch.response_mask.float()  # (B, T)
        # "correct": a positive reward is correct
        self.sums |= {"reward": rewards.sum(), "correct": (rewards > 0).sum(),
                      "seqs": len(batch), "tokens": mask.sum(), "truncated": batch.truncated.sum(),
                      "zero_adv": (advantages == 0).sum()}
        # --entropy-change: (B, T) bool, the graded part of each response (graded_tokens)
        self.graded = None
        if self.cfg.entropy_change:
            self.graded = graded_tokens(batch, self.tokenizer, self.cfg.reward)
            self.sums |= dict.fromkeys([f"shares/{x}_{cell}" for x in ("grad", "n", "dH", "dHn")
                                        for cell in CELLS], 0.0)
        self.samples = self.probes.samples(texts, rewards.tolist(), prompt_rows)

    def weighed(self, k: int, mb, pi_theta: TokenStats, weights: stapo.TokenWeights,
                N: float) -> None:
        """--gradient-share: the parameter gradient of the objective's terms at the candidates it
        keeps (A > 0, p < tau_p, weight > 0), with the same N, made before the update's (on every
        rank; none when no rank has such a candidate, and on policy, where p is known only from
        the update's forward); the gradients are zeroed again after."""
        self.part = None
        if not self.cfg.gradient_share:
            return
        kept = s2t.candidates(pi_theta.logprobs, mb.advantages, mb.mask, self.cfg.tau_p)  # (b, T)
        kept &= weights.weights > 0
        if all_sum(kept.sum())[0] == 0:
            return
        self.probes.gradient(mb, weights.weights * kept, N)
        self.part = [p.grad.detach().clone() for p in self.probes.parameters()]
        for p in self.probes.parameters():
            p.grad = None

    def backward(self, k: int, mb, pi_theta: TokenStats, weights: stapo.TokenWeights,
                 update) -> None:
        """The gradient shares (--gradient-share), what the mask did (`s2t`), the forward's token
        counts and clip statistics, or a skipped update."""
        self.update = update
        if self.part is not None:
            self.gradient_share(self.part)
        self.s2t(k, mb, pi_theta, weights)
        if update is None:
            self.counts["skipped/zero_adv"] += 1
            return
        for key, value in update.sums.items():
            self.sums[key] += value

    def updated(self, k: int, mb, pi_theta: TokenStats, weights: stapo.TokenWeights,
                grad_norm: float | None) -> None:
        """An optimizer step (its gradient norm and this rank's losses; --entropy-change: what it
        did to the entropy), or none, for a non-finite gradient norm."""
        if self.update is None:
            return
        if grad_norm is None:
            warnings.warn(f"step {self.step} mini-batch {k}: non-finite gradient norm, update "
                          "skipped")
            self.counts["skipped/nonfinite"] += 1
            return
        self.counts["updates"] += 1
        self.grad_norm_sum += grad_norm
        self.sums["loss/policy"] += self.update.loss
        self.sums["loss/kl"] += self.update.kl
        if self.cfg.entropy_change:  # what the update did to the entropy at each kind of position
            self.entropy_change(k, mb, pi_theta, self.probes.stats(mb.rollout).entropy, weights)

    def s2t(self, k: int, mb, pi_theta: TokenStats, weights: stapo.TokenWeights) -> None:
        """What the mask did in mini-batch k, from p, H of the policy it saw (pi_theta) and pi_old
        (mb.pi_old): counts, p, H and closed-form logit-gradient norms (w = r A, 0 where clipped) of
        silenced vs kept tokens, up to --spurious-per-step spurious.jsonl lines and a tokens.jsonl
        record."""
        cfg, tokenizer, ids = self.cfg, self.tokenizer, mb.rollout.response_ids
        w = stapo.surrogate_weight(pi_theta.logprobs, mb.pi_old.logprobs, mb.advantages,  # (b, T)
                                   *stapo.clip_range(cfg.algo, cfg.clip_low, cfg.clip_high),
                                   cfg.dual_clip)
        g = s2t.grad_norm_logits(w, pi_theta.logprobs, pi_theta.collision)  # (b, T)
        diag = s2t_diagnostics.diagnostics(pi_theta, mb.advantages, mb.mask, weights.silenced,
                                           cfg.tau_p, grad_norm=g)
        rule = weights.rule  # (b, T) what S2T silences, whatever --algo does: the step's own
        if rule is None:  # on policy p and H came with the update: the rule once, for this metric
            rule = on_policy_rule(pi_theta, mb, cfg)
        self.sums["rule_silenced"] += rule.sum().item()
        # the closed-form logit-gradient norm per kind of token and part of the response
        if self.graded is not None:
            for cell, sel in self.cells(k, mb, pi_theta).items():
                self.sums[f"shares/grad_{cell}"] += g[sel].sum().item()
                self.sums[f"shares/n_{cell}"] += sel.sum().item()
        for key, value in diag.items():  # sums and counts, divided in `result`
            self.sums[key] += value
        left = max(cfg.spurious_per_step - len(self.spurious), 0)
        self.spurious += [{"step": self.step, "mini_batch": k,
                           "token": tokenizer.decode([int(ids[i, t])]),
                           "context": tokenizer.decode(ids[i, max(0, t - 12):t].tolist()),
                           "p": math.exp(float(pi_theta.logprobs[i, t])),
                           "H": float(pi_theta.entropy[i, t]),
                           "advantage": float(mb.advantages[i, t])}
                          for i, t in weights.silenced.nonzero().tolist()[:left]]
        # what S2T saw: a seeded sample of the mini-batch's tokens for OUT/tokens.jsonl
        if cfg.token_sample:
            gen = torch.Generator().manual_seed(
                hash((cfg.seed, self.step - 1, k, self.rank)) % 2**62)
            sampled = s2t_diagnostics.token_sample(pi_theta, mb.advantages, mb.mask,
                                                   weights.silenced, cfg.token_sample, gen,
                                                   cfg.tau_p, w)
            self.tokens.append(s2t_diagnostics.token_record(self.step, k, weights.threshold,
                                                            sampled, mb.correct))

    def gradient_share(self, part: list[torch.Tensor]) -> None:
        """--gradient-share: the parameter-gradient norms of the whole objective g, of its terms at
        the candidates g_c (`weighed`) and of the rest g - g_c, before the clip (cancellation
        counted: these are norms of sums, unlike the per-token logit-gradient norms of
        shares/*)."""
        whole = [p.grad.detach() for p in self.probes.parameters()]
        norms = [torch.nn.utils.get_total_norm(g)
                 for g in (whole, part, [a - b for a, b in zip(whole, part)])]
        g, g_c, rest = (float(n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms)
        self.counts["grad_share/n"] += 1  # equal on every rank: the norms are global
        for key, value in (("all", g), ("candidates", g_c), ("without", rest)):
            self.grad_share[key] += value

    def entropy_change(self, k: int, mb, pi_theta: TokenStats, entropy_after: torch.Tensor,
                       weights: stapo.TokenWeights) -> None:
        """--entropy-change: the entropy at mini-batch k's positions before its update (with the p
        that makes the candidates) and after it (b, T), summed per kind of token
        (s2t_diagnostics.entropy_change) and per kind x part (s2t_diagnostics.token_cells)."""
        candidates = s2t.candidates(pi_theta.logprobs, mb.advantages, mb.mask,  # (b, T)
                                    self.cfg.tau_p)
        change = s2t_diagnostics.entropy_change(pi_theta.entropy, entropy_after, mb.mask,
                                                weights.silenced, candidates)
        for key, value in change.items():
            self.sums[key] += value
        delta = (entropy_after - pi_theta.entropy).float()  # (b, T) dH
        for cell, sel in self.cells(k, mb, pi_theta).items():
            self.sums[f"shares/dH_{cell}"] += delta[sel].sum().item()
            self.sums[f"shares/dHn_{cell}"] += sel.sum().item()

    def cells(self, k: int, mb, pi_theta: TokenStats) -> dict[str, torch.Tensor]:
        """Mini-batch k's response tokens split into kind x part (s2t_diagnostics.token_cells), each
        (b, T) bool."""
        b = len(mb.rollout)
        graded = self.graded[k * b:(k + 1) * b].to(mb.mask.device)  # (b, T)
        return s2t_diagnostics.token_cells(pi_theta.logprobs, mb.advantages, mb.mask, graded,
                                           self.cfg.tau_p)

    def result(self, lr: float) -> StepResult:
        """The step's metrics.jsonl line from the sums of all ranks (lr: the learning rate after
        the step), and its other records."""
        t_update = time.time() - self.t0
        # pi_old's entropy and distance from the sampler, all rows
        mask = self.batch.response_mask.float()  # (B, T)
        self.sums["entropy"] += (self.pi_old.entropy * mask).sum()
        self.sums["logprob_diff"] += \
            ((self.pi_old.logprobs - self.batch.sampler_logprobs).abs() * mask).sum()
        tot = dict(zip(self.sums, all_sum(*self.sums.values())))
        counts, updates = self.counts, self.counts["updates"]

        def mean(key, n):
            return tot[key] / max(n, 1)

        n_seq, n_tok, n_loss = tot["seqs"], tot["tokens"], tot["loss_tokens"]
        n_sil, n_kept, t_rollout = tot["silenced"], tot["kept"], self.t_rollout
        metrics = {
            "step": self.step, "reward/mean": mean("reward", n_seq),
            "reward/acc": mean("correct", n_seq), "response/len_mean": mean("tokens", n_seq),
            "response/truncated_frac": mean("truncated", n_seq),
            "entropy/mean": mean("entropy", n_tok),
            "rollout/logprob_diff": mean("logprob_diff", n_tok),
            "adv/zero_frac": mean("zero_adv", n_seq),
            "s2t/candidates": tot["candidates"], "s2t/silenced": n_sil,
            "s2t/rule_silenced": tot["rule_silenced"],
            "s2t/silenced_frac": mean("silenced", n_sil + n_kept),
            "s2t/silenced_p_mean": mean("silenced_p", n_sil),
            "s2t/silenced_h_mean": mean("silenced_h", n_sil),
            "s2t/grad_norm_silenced": mean("gn_silenced", n_sil),
            "s2t/grad_norm_kept": mean("gn_kept", n_kept),
            "loss/policy": mean("loss/policy", updates), "loss/kl": mean("loss/kl", updates),
            "clip/frac_low": mean("clip/frac_low", n_loss),
            "clip/frac_high": mean("clip/frac_high", n_loss),
            "clip/frac_dual": mean("clip/frac_dual", n_loss),
            "batch/pad_frac":
                1 - tot["real_tokens"] / tot["attention_cells"] if tot["attention_cells"] else 0.0,
            "batch/shared_frac":
                1 - tot["computed_tokens"] / tot["real_tokens"] if tot["real_tokens"] else 0.0,
            "ratio/mean": mean("ratio/mean", n_loss), "kl/approx": mean("kl/approx", n_loss),
            "grad_norm": self.grad_norm_sum / max(updates, 1),
            "lr": lr,
            **{k: float(v) for k, v in counts.items()},
            "time/rollout_s": t_rollout, "time/update_s": t_update,
            "tokens_per_s": n_tok / max(t_rollout + t_update, 1e-9),
        }
        if self.cfg.gradient_share:  # mean norms over the mini-batches with candidates
            metrics |= {f"grad_share/{key}": value / max(counts["grad_share/n"], 1)
                        for key, value in self.grad_share.items()}
        # mean H_after - H_before over the step's updates, per kind of token
        if self.cfg.entropy_change:
            metrics |= {f"entropy_change/{kind}": mean(f"entropy_change/{kind}_sum",
                                                       tot[f"entropy_change/{kind}_n"])
                        for kind in ENTROPY_KINDS}
            g_all = sum(tot[f"shares/grad_{cell}"] for cell in CELLS)
            # share of the summed logit-gradient norm, tokens, mean entropy change per update
            for cell in CELLS:
                metrics[f"shares/grad_{cell}"] = \
                    tot[f"shares/grad_{cell}"] / g_all if g_all else 0.0
                metrics[f"shares/n_{cell}"] = tot[f"shares/n_{cell}"]
                metrics[f"shares/dH_{cell}"] = mean(f"shares/dH_{cell}", tot[f"shares/dHn_{cell}"])
        return StepResult(metrics, self.spurious, self.samples, self.tokens)


def completions(run, step: int, split: str, texts: list[str], rewards: list[float],
                prompt_rows: list[int], group_size: int) -> list[dict]:
    """samples.jsonl records of the first response to each of the first --samples-per-step prompts
    of `split` ("train" or "heldout"): the prompt as the model saw it, the response, the gold answer
    and the reward (texts[i] answers prompt_rows[i // group_size])."""
    rows, prompts = (run.rows, run.prompts) if split == "train" else \
        (run.test_rows, run.test_prompts)
    return [{"step": step, "split": split, "prompt": run.tokenizer.decode(prompts[r]),
             "response": texts[j * group_size], "answer": rows[r]["answer"],
             "reward": rewards[j * group_size]}
            for j, r in enumerate(prompt_rows[:run.cfg.samples_per_step])]
