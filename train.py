"""Train a causal LM with STAPO or a baseline by RL on verifiable math rewards (docs/paper.md §3-§4
and Algorithm 1; the recipe of §6), on 1 CPU, 1 GPU or many GPU nodes with the same code.

    python train.py                               # no GPU: the CPU default (SmolLM2-135M, sums)
    torchrun --standalone --nproc_per_node=2 train.py --out-dir out/train-cpu-2   # 2 processes
    python train.py --model Qwen/Qwen3-1.7B-Base  # 1 GPU: the paper's recipe (DAPO-Math-17k, G = 8)
    python train.py --plot runs/stapo runs/justrl # the runs overlaid (reports/report.py)

Reading order: `train_step` (one RL step, numbered 1-4) and the functions it calls, in the order it
calls them; `train`, the loop (held-out evaluations, checkpoints, stops, the closing lines); `setup`
and `main`. The machinery it calls: config.py (what a run is told), run_folder/ (checkpoints, logs,
resume, stop signals), reports/ (figures, closing lines), step_metrics/ (the metrics line),
distributed/ (`all_sum`, `gather`, FSDP2), engines/ (the rollout engines), eval.py (the held-out
evaluation). Deliberate differences D38-D46: docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

from startup import early  # first: MKL's reproducible sums, before torch loads

if __name__ == "__main__":  # a stop signal while the modules load waits for the run to take it
    early.hold_signals("train.py")

import torch  # noqa: E402 - after startup.early
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import config  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
import run_folder  # noqa: E402
import stapo  # noqa: E402
from command_line import errors  # noqa: E402
from data import prompt_indices, rank_slice  # noqa: E402
from distributed.process_group import (  # noqa: E402
    all_gather_cat, all_max, all_sum, gather, init_distributed)
from engines.choice import compute_dtype, prompts_per_call  # noqa: E402
from evaluation.heldout import evaluate_heldout  # noqa: E402
from model import TokenStats  # noqa: E402
from reports import report  # noqa: E402
from run_folder import ModelAndOptimizer, plural, read_log, say  # noqa: E402
from startup.run import Run, setup  # noqa: E402
from step_metrics import s2t_diagnostics  # noqa: E402
from step_metrics.step_log import Probes, StepLog, StepResult, completions  # noqa: E402
from step_metrics.step_warnings import busy, zero_gradient  # noqa: E402
from step_metrics.watch import Watch, Watches  # noqa: E402


# ----------------------------------------------------------------------------------------- the step
def train_step(run: Run, step: int, watch: Watch = Watch()) -> bool:
    """Step `step` (counted from 1): one rollout batch and its mini-batch updates, the paper's
    Algorithm 1. False when a stop signal came during the rollout (nothing was updated). `watch`
    sees the step's decisions at four moments (step_metrics/watch.py: the metrics line, the
    instruments, the counterfactual's replay)."""
    cfg, G, policy = run.cfg, run.cfg.group_size, run.policy
    # 1. Rollout: G responses y_i ~ pi_old to each of this rank's prompts (D40: seeded per call).
    batch, prompt_rows = sample(run, step)  # prompt_rows: the training row of each prompt
    if run.preemption.agreed():  # a stop signal came during the rollout: drop the step
        return False
    # 2. Rewards R_i, advantages A_i = (R_i - mean_j R_j) / (std_j R_j + eps); a group: one rank.
    texts = batch.texts(run.tokenizer)
    rows = [run.rows[prompt_rows[i // G]] for i in range(len(texts))]  # each response's data row
    rewards = torch.tensor(reward.rewards(texts, [r["answer"] for r in rows], cfg.reward, rows))
    advantages = stapo.group_advantages(rewards, G).to(run.device)  # (B,)
    # 3. pi_old: p, H and collision of the policy that sampled, before the step's updates (D39).
    pi_old = old_policy_stats(run, batch)  # TokenStats of (B, T) each
    watch.rolled_out(batch, texts, prompt_rows, rewards, advantages, pi_old)

    # 4. Mini-batch updates, each with the token weights I of its own pi_theta (Algorithm 1).
    policy.train()
    for k, mb in enumerate(mini_batches(run, step, batch, rewards, advantages, pi_old)):
        # pi_theta: p, H (and collision) of the current policy; before the first update, pi_old's
        pi_theta = mb.pi_old if k == 0 else token_stats(policy, mb.rollout, cfg, run.device)
        # I_it (STAPO: 0 where S2T silences, A > 0, p < tau_p, H < tau_h) and this rank's share
        # of N; thresholds over the whole mini-batch
        weights = stapo.token_weights(cfg.algo, pi_theta.logprobs, pi_theta.entropy,
                                      mb.advantages, mb.mask, cfg.tau_p, cfg.quantile, mb.context)
        N = all_sum(weights.share)[0]  # N = sum_i sum_t I_it over the whole mini-batch (D31)
        run.optimizer.zero_grad(set_to_none=True)
        watch.weighed(k, mb, pi_theta, weights, N)
        # the gradient of -J, micro-batch by micro-batch; None: nothing to learn (D43)
        update = accumulate_gradients(run, mb, weights.weights, N)
        watch.backward(k, mb, pi_theta, weights, update)
        grad_norm = optimizer_step(run) if update else None  # None: no step was made
        watch.updated(k, mb, pi_theta, weights, grad_norm)
    run.optimizer.zero_grad(set_to_none=True)
    return True


def sample(run: Run, step: int) -> tuple[rollout.Rollout, list[int]]:
    """(this rank's rollout batch of step `step` on the policy's device, the training row of each
    prompt): its prompts in mini-batch order (`rank_slice`), each generate call seeded from (seed,
    step, global index of its first prompt) (D40)."""
    cfg, position = run.cfg, step - 1  # the steps before this one: the data position
    indices = prompt_indices(position, len(run.rows), cfg)
    positions = rank_slice(len(indices), cfg, run.rank, run.world)
    prompt_rows = [indices[i] for i in positions]
    chunk = prompts_per_call(cfg, len(prompt_rows), run.policy.lm.config,
                             compute_dtype(cfg, run.device).itemsize)
    seeds = [hash((cfg.seed, position, position * cfg.prompts_per_step + i)) % 2**62
             for i in positions[::chunk]]
    run.policy.eval()
    with run.engine.ready(run.policy):  # plain: parameters gathered; vllm: current weights pushed
        batch = run.engine.sample([run.prompts[i] for i in prompt_rows], cfg.group_size, seeds,
                                  chunk, cfg.max_response_len, cfg.temperature, cfg.top_p)
    return batch.to(run.device), prompt_rows  # the engine's device (vLLM: the CPU) -> the policy's


def on_policy(cfg: config.Config) -> bool:
    """Whether the update's own forward stands in for the pi_old pass: one mini-batch per step (the
    policy has not moved when that forward runs, so pi_old = its log-probs, detached: ratio 1),
    weights that need no p or H before it (JustRL, GRPO) and no TIS (which weighs by pi_old before
    the loss)."""
    return (cfg.mini_batch_prompts == cfg.prompts_per_step
            and stapo.ALGORITHMS[cfg.algo].silence is None and cfg.tis_cap is None)


def old_policy_stats(run: Run, batch: rollout.Rollout) -> TokenStats:
    """pi_old: p, H and collision of the policy before the step's updates, (B, T) each (D39): a pass
    without gradients. On policy (`on_policy`) the update's own forward is that pass: the tensors
    start at 0 and `accumulate_gradients` fills them in, detached (ratio 1)."""
    if on_policy(run.cfg):
        return TokenStats(*(torch.zeros_like(batch.sampler_logprobs) for _ in range(3)))
    return token_stats(run.policy, batch, run.cfg, run.device)


@dataclass
class MiniBatch:
    """This rank's rows of one mini-batch and what their update reads."""
    rollout: rollout.Rollout
    advantages: torch.Tensor  # (b, T): A_i on every token of y_i
    pi_old: TokenStats  # p, H, collision, (b, T) each: rows of the step's pi_old
    ref_logprobs: torch.Tensor | None  # (b, T) GRPO's reference model with --kl-beta > 0, else None
    correct: torch.Tensor  # (b,) bool: a positive reward
    context: stapo.MiniBatchContext  # what stapo.token_weights needs beyond these rows

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.response_mask.float()  # (b, T)


def mini_batches(run: Run, step: int, batch: rollout.Rollout, rewards: torch.Tensor,
                 advantages: torch.Tensor, pi_old: TokenStats) -> Iterator[MiniBatch]:
    """This rank's rows of each of the step's mini-batches, in order (rank r holds rows r*b ..
    r*b+b-1 of each, `rank_slice`), with GRPO's reference log-probs (one pass over the batch) and
    the context of their token weights: the other ranks' rows, randmask's keys seeded from (seed,
    step, k), the --quantile-window, TIS's weights min(pi_old / pi_sampler, cap), whether p and H
    are known before the update (not on policy)."""
    cfg, b = run.cfg, run.cfg.mini_batch_prompts // run.world * run.cfg.group_size
    adv = advantages[:, None].expand_as(batch.sampler_logprobs)  # (B, T): A_i on every token of y_i
    ref = token_stats(run.ref_policy, batch, cfg, run.device).logprobs if run.ref_policy else None
    for k, first in enumerate(range(0, len(batch), b)):
        rows = slice(first, first + b)
        tis = None if cfg.tis_cap is None else stapo.tis_weight(  # (b, T)
            pi_old.logprobs[rows], batch.sampler_logprobs[rows], cfg.tis_cap)
        context = stapo.MiniBatchContext(all_gather_cat, hash((cfg.seed, step, k)) % 2**62,
                                         range(run.rank * b, (run.rank + 1) * b),
                                         cfg.max_response_len, run.window, tis, not on_policy(cfg))
        yield MiniBatch(batch.select(rows), adv[rows], pi_old.rows(rows),
                        None if ref is None else ref[rows], rewards[rows] > 0, context)


class Update(NamedTuple):
    """What `accumulate_gradients` did on this rank."""
    loss: float  # the policy loss -J of this rank's rows
    kl: float  # GRPO's KL term (0 without --kl-beta)
    sums: dict  # token counts and token-weighted clip statistics (the metrics line)


def accumulate_gradients(run: Run, mb: MiniBatch, weights: torch.Tensor, N: float) -> Update | None:
    """The gradient of one mini-batch's objective J (paper Eq. 3, stapo.policy_loss) accumulated
    over token-budget micro-batches, no optimizer step: sum_micro sum_ranks
    (world * loss_part) / world = J's gradient, however the rows are grouped. weights (b, T): the
    token weights I_it; N: the global denominator. None, and no gradient, when no rank has a token
    with A != 0 and I > 0 and there is no KL term: the gradient is 0 (D43); on policy a pass without
    gradients then fills pi_old in."""
    cfg, device = run.cfg, run.device
    if all_sum(((mb.advantages != 0) & (weights > 0)).sum())[0] == 0 and mb.ref_logprobs is None:
        if on_policy(cfg):
            for whole, part in zip(mb.pi_old, token_stats(run.policy, mb.rollout, cfg, device)):
                whole.copy_(part)
        return None
    clip = stapo.clip_range(cfg.algo, cfg.clip_low, cfg.clip_high)
    sums = dict.fromkeys(("computed_tokens", "attention_cells", "real_tokens", "loss_tokens",
                          *stapo.CLIP_STATS), 0.0)
    # the same count on every rank
    micro = mb.rollout.micro_batches(cfg.max_tokens_per_micro_batch, agree=all_max)
    for rows in micro:  # tokens the backbone runs (a shared prompt once), cells attention lays out
        computed, cells = mb.rollout.select(rows).packed_sizes()
        sums["computed_tokens"] += computed
        sums["attention_cells"] += cells
    sums["real_tokens"] += mb.rollout.lengths().sum().item()
    loss_sum = kl_sum = 0.0
    for rows in micro:
        # TokenStats, (b', T') each
        pi_theta = policy_forward(run.policy, mb.rollout.select(rows), cfg, device)
        cut = (rows, slice(0, pi_theta.logprobs.shape[1]))
        if on_policy(cfg):  # pi_old is this forward's, detached (ratio 1; `old_policy_stats`)
            for whole, piece in zip(mb.pi_old, pi_theta):
                whole[cut] = piece.detach()
        loss, stats = stapo.policy_loss(pi_theta.logprobs, mb.pi_old.logprobs[cut].to(device),
                                        mb.advantages[cut].to(device), weights[cut].to(device),
                                        *clip, cfg.dual_clip, N)
        if mb.ref_logprobs is not None:  # GRPO with --kl-beta > 0: + beta * sum(I * k3) / N
            kl = stapo.kl_term(pi_theta.logprobs, mb.ref_logprobs[cut].to(device),
                               weights[cut].to(device), N)
            loss = loss + cfg.kl_beta * kl  # the KL term, outside policy_loss (D35)
            kl_sum += kl.item()
        (loss * run.world).backward()  # FSDP2 divides the summed gradient by world (D42)
        loss_sum += loss.item()
        tokens = stats["loss/tokens"].item()
        sums["loss_tokens"] += tokens
        for key in stapo.CLIP_STATS:
            sums[key] += stats[key].item() * tokens if key in stats else 0.0  # token-weighted means
    return Update(loss_sum, kl_sum, sums)


def optimizer_step(run: Run) -> float | None:
    """Clip the gradient to --grad-clip and step the optimizer and the lr schedule: the norm before
    the clip, or None and no step when it is not finite (the norm is global: every rank agrees)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(run.policy.parameters(), run.cfg.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):  # D43
        run.optimizer.zero_grad(set_to_none=True)
        return None
    run.optimizer.step()
    run.scheduler.step()
    return grad_norm


def policy_forward(policy, rows: rollout.Rollout, cfg: config.Config, device) -> TokenStats:
    """p, H and collision of `policy` on `rows`, each (B, T') with T' <= T: all-padding prompt
    columns (left) and response columns (right) are dropped first."""
    P = rows.prompt_ids.shape[1]
    p0 = int((rows.prompt_mask.sum(0) > 0).nonzero()[0])
    t1 = int((rows.response_mask.sum(0) > 0).nonzero()[-1]) + 1
    # (B, P - p0 + T') each
    input_ids, attention_mask = (x[:, p0:P + t1].to(device) for x in rows.training_inputs())
    return policy(input_ids, attention_mask, rows.response_mask[:, :t1].to(device),
                  temperature=cfg.temperature, chunk_size=cfg.chunk_size)


def token_stats(policy, batch: rollout.Rollout, cfg: config.Config, device) -> TokenStats:
    """p, H and collision of the current policy, each (B, T) of the rollout's T on `device`,
    micro-batch by micro-batch without gradients."""
    whole = TokenStats(*(torch.zeros(batch.response_ids.shape, device=device) for _ in range(3)))
    with torch.no_grad():
        # the same count on every rank
        for rows in batch.micro_batches(cfg.max_tokens_per_micro_batch, agree=all_max):
            for values, piece in zip(whole,
                                     policy_forward(policy, batch.select(rows), cfg, device)):
                values[rows, :piece.shape[1]] = piece.float()
    return whole


# ----------------------------------------------------------------------------------------- the loop
def logged_step(run: Run, step: int, *watches: Watch) -> StepResult | None:
    """`train_step` watched by its metrics line (step_metrics/step_log.py) and `watches`: the
    step's records, or None when a stop signal dropped the step."""
    cfg = run.cfg
    log = StepLog(cfg, step, run.rank, run.tokenizer, Probes(
        lambda texts, rewards, rows: completions(run, step, "train", texts, rewards, rows,
                                                 cfg.group_size),
        lambda mb, weights, N: accumulate_gradients(run, mb, weights, N),
        lambda rows: token_stats(run.policy, rows, cfg, run.device), run.policy.parameters))
    if not train_step(run, step, Watches(log, *watches)):
        return None
    return log.result(run.scheduler.get_last_lr()[0])


def train(run: Run) -> int:
    """The training loop: steps, their logs, evaluations, checkpoints, the export. Returns the exit
    status: 0, or run_folder.STOPPED when a stop signal ended the run early (with a checkpoint).
    Step N (from 1) is the same N in the console, every log (eval.jsonl: evaluated after N
    steps, 0 = before training) and checkpoint/step_N (D46)."""
    cfg, start = run.cfg, run.start
    evaluated = {r["step"] for r in read_log(Path(cfg.out_dir) / "eval.jsonl")}
    # a resume's due evaluation; where a stop came
    stopped = eval_due(run, start) and start not in evaluated and not evaluate_heldout(run, start)
    where = f"in the evaluation after {plural(start, 'step')} (it runs again on resume)"
    saved = done = start  # the steps of the last checkpoint (a new run has none: 0), the steps done
    speeds = []  # tokens_per_s of this attempt's steps (a step far slower than the others: `busy`)
    with tqdm(total=cfg.steps, initial=start, desc=f"{cfg.algo} steps", dynamic_ncols=True,
              disable=run.rank != 0) as bar:  # closed also when an error leaves the loop
        for step in range(start + 1, cfg.steps + 1):
            if stopped:
                break
            result = logged_step(run, step)
            if result is None:  # a stop signal during the rollout
                stopped, where = True, f"in step {step}'s rollout (the step is dropped)"
                break
            done = step
            records = {"spurious.jsonl": gather(result.spurious)[:cfg.spurious_per_step],
                       "samples.jsonl": gather(result.samples)[:cfg.samples_per_step],
                       "tokens.jsonl": s2t_diagnostics.ranks_joined(gather([result.tokens])),
                       "metrics.jsonl": [result.metrics]}
            run_folder.write_logs(Path(cfg.out_dir), records, run.rank, run.logger)  # and --logger
            # silenced: tokens, as at the end
            bar.set_postfix({"train_acc": f"{result.metrics['reward/acc']:.2f}",
                             "H": f"{result.metrics['entropy/mean']:.2f}",
                             "silenced": int(result.metrics["s2t/silenced"])}, refresh=False)
            bar.update()
            if step == cfg.steps:
                bar.close()  # the final bar once, above the closing lines
            if zero := zero_gradient(result.metrics, cfg.group_size):  # all groups' rewards tied
                say(zero, run.rank, warning=True)
            speeds.append(result.metrics["tokens_per_s"])
            busy(run.device, run.rank, speeds)
            # one all-reduce
            stopped, where = run.preemption.agreed(), f"in step {step} (its updates finished)"
            if not stopped and eval_due(run, step) and not evaluate_heldout(run, step):
                stopped, where = True, (f"in the evaluation after {plural(step, 'step')} "
                                        "(it runs again on resume)")
            if not stopped and (step == cfg.steps
                                or (cfg.save_every and step % cfg.save_every == 0)):
                saved = checkpoint(run, step)  # a stop writes its own (`stop`)
    if stopped:
        return stop(run, done, saved, where)
    finish(run)
    return 0


def eval_due(run: Run, done: int) -> bool:
    """Whether the held-out set is evaluated after `done` steps: before training (unless
    --no-eval-before), every --eval-every steps and after the last one (when there is a held-out
    set)."""
    cfg = run.cfg
    return bool(run.test_rows and cfg.eval_samples) and (
        (done == 0 and cfg.eval_before) or done == cfg.steps
        or bool(cfg.eval_every and done % cfg.eval_every == 0))


def checkpoint(run: Run, done: int) -> int:
    """Write the checkpoint after `done` steps (every rank; run_folder.save_checkpoint); returns
    `done`."""
    cfg, trained = run.cfg, ModelAndOptimizer(run.policy, run.optimizer, run.scheduler)
    run_folder.save_checkpoint(Path(cfg.out_dir), done, trained, run_folder.recipe(asdict(cfg)),
                               run.rank, run.world,
                               {"s2t_window": run.window.values if run.window
                                else torch.zeros(0)})
    return done


def stop(run: Run, done: int, saved: int, where: str) -> int:
    """A stop signal ended the run after `done` steps: the checkpoint (unless the last one is of
    `done` steps; one that cannot be written, a full disk, is a warning: the previous one stays),
    then `stopped`; returns run_folder.STOPPED."""
    if saved != done:
        try:
            saved = checkpoint(run, done)
        except run_folder.RunError as e:
            say(str(e), run.rank, warning=True)
    if run.rank == 0 and run.logger:
        run.logger.close()
    return run_folder.stopped(run.cfg.out_dir, run.cfg.steps, run.rank, run.preemption, saved,
                              where, done)


def finish(run: Run) -> None:
    """After the last step: the export (unless up to date), the figures, and the closing lines (what
    the mask silenced, RQ1's correlations, a divergence, what the run wrote)."""
    cfg, out = run.cfg, Path(run.cfg.out_dir)
    if cfg.export_hf and run_folder.export_step(out / "hf") != cfg.steps:
        run_folder.export(run.policy, run.tokenizer, out, cfg.steps, compute_dtype(cfg, run.device),
                          run.rank)
    if run.rank != 0:
        return
    if run.logger:
        run.logger.close()
    report.closing_lines(cfg, out)


def main(argv: list[str] | None = None) -> int:
    """`python train.py [flags]`: exit status 0 (trained, or nothing left to do), 2 (a bad input or
    a full disk: one line), run_folder.STOPPED (a stop signal or Ctrl-C: a checkpoint was written,
    run the same command again), run_folder.INTERRUPTED (Ctrl-C again: left at once, the last
    checkpoint kept)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--plot" in argv:  # train.py --plot RUN [RUN ...]: figures only (reports/report.py)
        return report.main(argv)
    rank = int(os.environ.get("RANK", 0))  # until the process group exists: torchrun's env://
    run = lock = None
    # from here on, SIGTERM / SIGUSR1 / SIGINT: a checkpoint, exit
    with run_folder.Preemption() as preemption:
        preemption.command = run_folder.continue_command(argv)  # the command with --resume auto
        try:
            cfg, recorded, notes = config.parse_config(argv)
            rank, world, device = preemption.starting(init_distributed, cfg.collective_timeout_min)
            for note in notes if rank == 0 else ():
                print(f"train.py: {note}", file=sys.stderr, flush=True)
            rows = run_folder.agree(config.read_inputs, cfg, world)  # the inputs before the folder
            opened = run_folder.open_run(config.run_record(cfg, rows), recorded, rank, world,
                                         preemption.command)
            if opened is None:
                up_to_date = " and its export is up to date" if cfg.export_hf else ""
                say(f"{cfg.out_dir} has done its {plural(cfg.steps, 'step')}{up_to_date}: "
                    "nothing to do", rank)
                return 0
            start, checkpoint_path, lock = opened
            preemption.on_leave = lambda name: run_folder.leave_at_interrupt(cfg.out_dir, rank,
                                                                             preemption, name)
            if cfg.stop_deadline_s:
                preemption.arm(cfg.stop_deadline_s, lambda: run_folder.leave_at_deadline(
                    cfg.out_dir, cfg.stop_deadline_s, rank, preemption))
            if preemption.agreed():  # a stop signal during startup: stop before the model loads
                return run_folder.stopped(cfg.out_dir, cfg.steps, rank, preemption, start,
                                          "during startup")
            busy(device, rank, [])
            run = setup(cfg, rows, rank, world, device, checkpoint_path, preemption)
            return train(run)
        except reward.RewardError as e:  # your --reward function failed: fix it and continue
            return run_folder.failure("train.py", f"{errors.one_line(e)}; fix it, then continue "
                                      f"with: {preemption.command}", rank, own=True)
        except Exception as e:  # a bad input: one line; after another rank failed: none
            return run_folder.failure("train.py", e, rank)
        finally:
            if run is not None:
                # the rollout engine; deleting a vLLM engine may already tear down the group
                run.engine.close()
            if lock is not None:
                lock.release()
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    early.leave(main())  # without interpreter teardown (startup/early.py)
