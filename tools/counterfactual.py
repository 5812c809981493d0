"""The counterfactual contribution of a response token to the reward: does a silenced token matter?
(RQ2, docs/paper.md §8 and §4)

    python -m tools.counterfactual RUN  # step 1 of a train.py run, K = 32, 16 tokens of each kind
    python -m tools.counterfactual RUN --steps 1 11 --k 16 --tokens 8 --plot
    python -m tools.counterfactual --table RUN [RUN ...] [--out PNG]
        # many analysed runs pooled per algorithm

S2T silences low-probability, low-entropy tokens of correct responses because, the paper says,
they "contribute negligibly to the correct reasoning outcome". This file measures that
contribution, effect(y_t) = P(success | x, y_<=t) - P(success | x, y_<t), and its contrast
against a redraw without y_t, from K graded continuations per side, for the tokens a replayed
step silenced, the candidates it kept and other tokens (the estimator and its intervals:
docs/experiments.md, "The counterfactual estimator"). Deliberate choices D58-D65: docs/paper.md.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from command_line import errors, flags
import config
import reward
import run_folder
import s2t
import stapo
from distributed.process_group import init_distributed
from reports import figures
from startup.run import setup
from step_metrics.step_log import on_policy_rule
from step_metrics.watch import Watch
from tools.counterfactual_tables import (KINDS, cluster_interval, mean, newcombe, pooled_groups,
                                         pooled_summary, summary, variance)


# ------------------------------------------------------------------------------------ the estimator
class Effect(NamedTuple):
    """The estimate for one token y_t of response `row`."""
    row: int
    t: int
    k: int  # continuations per side
    keep: float  # success rate of K continuations of x, y_<=t
    resample: float  # success rate of K continuations of x, y_<t (the policy redraws position t)
    effect: float  # keep - resample
    stderr: float  # sqrt(s_keep^2 / K + s_resample^2 / K)
    # success rate of K continuations of x, y_<t, z (z: the policy's redraw, never y_t)
    exclude: float
    contrast: float  # keep - exclude: Q(y_t) - Q(not y_t)
    contrast_ci: tuple[float, float]  # Newcombe's 95% interval of the contrast


class _Prefix(NamedTuple):
    token: int  # index into `tokens`
    side: str  # "keep" (x, y_<=t), "resample" (x, y_<t) or "exclude" (x, y_<t, never y_t next)
    response: list[int]  # the response tokens in the prefix
    budget: int  # new tokens it may still get (0: the prefix is the whole response)


def token_effects(sample: Callable, grade: Callable, rows: list[tuple[list[int], list[int]]],
                  tokens: list[tuple[int, int]], k: int, max_response_len: int, seed: int = 0,
                  prefixes_per_call: int = 16) -> list[Effect]:
    """The effect of each token (row, t) of `tokens` on the success of its response, in the order of
    `tokens`.

    sample(prefixes, k, max_new_tokens, seed, exclude=None) -> list of k * len(prefixes)
        continuations (token id lists, prefix i's at [i k, (i + 1) k), each ending at EOS (included)
        or after max_new_tokens): the policy that sampled the responses, continuing each prefix (a
        prompt followed by response tokens) k times; with exclude (one token id per prefix), no
        continuation of prefix i starts with exclude[i] (the policy's next-token distribution
        without it, renormalized).
    grade(row, response) -> float: the reward of a whole response (token ids) to prompt
    `row`; > 0 is a success (D58).
    rows[row] = (prompt, response): token ids (a response: its generated tokens, EOS included, no
    padding).
    """
    if k < 2:
        raise ValueError(f"k must be >= 2 (a standard error needs two outcomes), got {k}")
    prefixes = []
    for j, (row, t) in enumerate(tokens):
        y = rows[row][1]
        if not 0 <= t < len(y):
            raise ValueError(f"token {t} of row {row} is outside its {len(y)}-token response")
        # y_t is the response's EOS or its last token at the budget (D60)
        ends = t + 1 == len(y)
        prefixes += [_Prefix(j, "keep", y[:t + 1], 0 if ends else max_response_len - (t + 1)),
                     _Prefix(j, "resample", y[:t], max_response_len - t),  # D59
                     _Prefix(j, "exclude", y[:t], max_response_len - t)]
    outcomes = {}  # (token, side) -> K successes (0/1)
    for p in prefixes:
        if p.budget == 0:  # the response itself, K times
            outcomes[p.token, p.side] = [float(grade(tokens[p.token][0], p.response) > 0)] * k
    calls = []  # the redraws without y_t in calls of their own; longest budget first (D61)
    for redraw in (False, True):
        todo = sorted((p for p in prefixes if p.budget > 0 and (p.side == "exclude") == redraw),
                      key=lambda p: -p.budget)
        calls += [todo[i:i + prefixes_per_call] for i in range(0, len(todo), prefixes_per_call)]
    for c, part in enumerate(calls):
        exclude = [rows[tokens[p.token][0]][1][tokens[p.token][1]] for p in part] \
            if part[0].side == "exclude" else None
        continuations = sample([rows[tokens[p.token][0]][0] + p.response for p in part], k,
                               part[0].budget, hash((seed, c)) % 2**62, exclude)
        for i, p in enumerate(part):
            row = tokens[p.token][0]
            outcomes[p.token, p.side] = [float(grade(row, p.response + list(cont[:p.budget])) > 0)
                                         for cont in continuations[i * k:(i + 1) * k]]
    effects = []
    for j, (row, t) in enumerate(tokens):
        keep, resample, exclude = \
            outcomes[j, "keep"], outcomes[j, "resample"], outcomes[j, "exclude"]
        effects.append(Effect(row, t, k, mean(keep), mean(resample),
                              mean(keep) - mean(resample),
                              math.sqrt(variance(keep) / k + variance(resample) / k),
                              mean(exclude), mean(keep) - mean(exclude),
                              newcombe(int(sum(keep)), int(sum(exclude)), k)))
    return effects


def engine_sampler(engine, temperature: float, top_p: float) -> Callable:
    """`token_effects`'s sample() from a rollout engine (PlainEngine or VLLMEngine, inside
    its `ready`): the prefixes are prompts, one generate call for all of them (the K rows of a
    prefix share its prefill). With `exclude`, the first token of each continuation comes from
    `redraw_without` (the plain engine's model), the rest from the engine."""
    def sample(prefixes: list[list[int]], k: int, max_new_tokens: int, seed: int,
               exclude: list[int] | None = None) -> list[list[int]]:
        if exclude is not None:
            if not hasattr(engine, "lm"):
                raise ValueError("the contrast (a redraw without the token) needs the plain "
                                 "rollout engine")
            firsts = redraw_without(engine.lm, prefixes, exclude, k, temperature, top_p,
                                    engine.vocab_size, seed)
            # (n k) first tokens, prefix i's at [i k, (i + 1) k)
            heads = [[z] for row in firsts for z in row]
            # to be continued
            go = [j for j, h in enumerate(heads) if h[0] != engine.eos and max_new_tokens > 1]
            rest = sample([prefixes[j // k] + heads[j] for j in go], 1, max_new_tokens - 1,
                          seed + 1) if go else []
            for j, tail in zip(go, rest):
                heads[j] += tail
            return heads
        out = engine.sample(prefixes, k, [seed], len(prefixes), max_new_tokens, temperature, top_p)
        return [ids[mask.bool()].tolist() for ids, mask in zip(out.response_ids, out.response_mask)]
    return sample


def redraw_without(lm, prefixes: list[list[int]], exclude: list[int], k: int, temperature: float,
                   top_p: float, vocab_size: int | None, seed: int) -> list[list[int]]:
    """k draws of the token after each prefix from the sampler's distribution (logits / temperature,
    then the top-p nucleus, rollout._sample's rule) with exclude[i] removed and the rest
    renormalized (the whole tempered softmax without it when the nucleus held nothing else). Never
    returns exclude[i]."""
    device, g, out = next(lm.parameters()).device, torch.Generator().manual_seed(seed), []
    for prefix, token in zip(prefixes, exclude):
        ids = torch.tensor([prefix], device=device)  # (1, L)
        with torch.no_grad():
            z = lm(input_ids=ids,
                   attention_mask=torch.ones_like(ids)).logits[0, -1, :vocab_size].float().cpu()
        probs = torch.softmax(z / temperature, dim=-1)  # (V,)
        # the nucleus: most likely tokens until the mass before a token reaches top_p
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            probs = torch.zeros_like(probs).scatter(
                0, order, sorted_p * (sorted_p.cumsum(0) - sorted_p < top_p))
        probs[token] = 0.0
        if probs.sum() <= 0:  # the nucleus was the token alone
            probs = torch.softmax(z / temperature, dim=-1).index_fill(0, torch.tensor([token]), 0.0)
        out.append(torch.multinomial(probs / probs.sum(), k, replacement=True,
                                     generator=g).tolist())
    return out


# --------------------------------------------------------------------------------------- the tokens


def pick_tokens(silenced: torch.Tensor, candidates: torch.Tensor, response_mask: torch.Tensor,
                correct: torch.Tensor, n: int,
                generator: torch.Generator) -> list[tuple[str, int, int]]:
    """(kind, row, t) of at most n tokens of each kind, drawn uniformly (`generator`), in (kind,
    row, t) order: 'silenced' (the algorithm's mask), 'candidate' (A > 0, p < tau_p, kept) and
    'other' (the remaining response tokens of correct responses). silenced, candidates,
    response_mask (B, T); correct (B,) bool."""
    mask = response_mask.bool()  # (B, T)
    silenced = silenced & mask
    kinds = {"silenced": silenced, "candidate": candidates & mask & ~silenced,
             "other": mask & ~candidates & ~silenced & correct[:, None]}
    picked = []
    for kind in KINDS:
        where = kinds[kind].nonzero()  # (m, 2) rows (row, t)
        take = where[torch.randperm(len(where), generator=generator)[:n]]
        picked += [(kind, int(row), int(t)) for row, t in sorted(take.tolist())]
    return picked


# -------------------------------------------------------------------------------- one step of a run
@dataclass
class Step:
    """What the policy of a run saw and decided in one step, every mini-batch (`regenerate_step`);
    B = its rows."""
    cfg: object  # the run's config.Config
    tokenizer: object
    policy: object  # pi_old of the step (model.Policy): the policy that sampled the rollout
    engine: object  # the run's rollout engine
    prompts: list[list[int]]  # (B,) prompt ids
    responses: list[list[int]]  # (B,) response ids, EOS included
    answers: list[str]  # (B,) gold answer of each row
    data_index: list[int]  # (B,) row of the training data each prompt comes from
    mini_batch: list[int]  # (B,) the mini-batch each row was updated in
    score: Callable  # score(text, b) -> the run's reward of text answering batch row b
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)
    # (B, T) log p of the policy the mask saw (pi_old in mini-batch 0, then after k updates)
    logprobs: torch.Tensor
    entropy: torch.Tensor  # (B, T) H, the same
    response_mask: torch.Tensor  # (B, T)
    silenced: torch.Tensor  # (B, T) bool: the algorithm's mask
    candidates: torch.Tensor  # (B, T) bool: A > 0, p < tau_p
    # (B, T) bool: what the S2T rule (the run's tau_p, q) silences, whatever the algorithm (D65)
    s2t_rule: torch.Tensor
    # the regenerated rollout and masks agree with the run's logs (None: no line)
    matches_run: bool | None


class Replay(Watch):  # D63
    """Each mini-batch's decision as the replayed step made it (`regenerate_step`): p, H, the mask,
    the candidates and S2T's rule, on the CPU."""

    def __init__(self, batch, cfg, step: int):
        self.batch, self.cfg, self.step, self.seen = batch, cfg, step, []

    def backward(self, k, mb, pi_theta, weights, update) -> None:
        adv, mask, first = mb.advantages, mb.mask, sum(x[1] for x in self.seen)
        if not torch.equal(mb.rollout.response_ids.cpu(),
                           self.batch.response_ids[first:first + len(mb.rollout)].cpu()):
            raise ValueError(f"step {self.step}: the replayed rollout differs from the "
                             "regenerated one (not seeded?)")
        rule = weights.rule  # S2T's rule: the step's own, or once here (on policy)
        if rule is None:
            rule = on_policy_rule(pi_theta, mb, self.cfg)
        self.seen.append((k, len(mb.rollout), pi_theta.logprobs.cpu(), pi_theta.entropy.cpu(),
                          mask.cpu(), weights.silenced.cpu(),
                          s2t.candidates(pi_theta.logprobs, adv, mask, self.cfg.tau_p).cpu(),
                          rule.cpu()))


def regenerate_step(run_dir: Path, step: int) -> Step:
    """Step `step` (from 1) of the train.py run in `run_dir`, every mini-batch, as the run made it.

    The one function of this file that reaches into train.py's internals (`setup`, the checkpoint
    layout, `sample`, `train_step`, the reward call; the run's Config is config.py's), so that a
    change of them is adapted here only. It rebuilds the run in this process (one process, the run's
    recipe and rollout engine), loads the policy that made the step's decisions (the model,
    optimizer and scheduler of checkpoint/step_<step - 1>, or the initial ones for step 1),
    regenerates the step's rollout (seeded per generate call from (seed, step, prompt index)), then
    replays the step's updates with `train.train_step` to see each mini-batch's p, H and mask as the
    run computed them (mini-batch k after k updates), and puts the policy back to pi_old, which
    samples the continuations."""
    import train

    recorded = config.Config(**flags.check_values(config.Config,
                                                  run_folder.recorded_config(run_dir),
                                                  str(run_dir)))
    # the replay needs the masks only (the flag moves nothing)
    cfg = replace(recorded, entropy_change=False)
    if step > 1 and step - 1 not in run_folder.complete_steps(run_dir):
        kept = sorted(run_folder.complete_steps(run_dir))
        raise FileNotFoundError(f"step {step} needs the policy after step {step - 1}, "
                                f"checkpoint/step_{step - 1}, which the run did not keep (its "
                                f"checkpoints: {', '.join(f'step_{s}' for s in kept) or 'none'}; "
                                f"so steps {', '.join(str(s + 1) for s in [0, *kept])} can be "
                                f"analysed; keep more with --save-every 1 --keep-checkpoints N)")
    if not torch.distributed.is_initialized():
        init_distributed()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = setup(cfg, config.read_inputs(cfg, 1), 0, 1, device, None,
                      run_folder.Preemption())
    # the state after step - 1: model, optimizer and scheduler (the replay makes the run's updates)
    if step > 1:
        trained = run_folder.ModelAndOptimizer(run.policy, run.optimizer, run.scheduler)
        run_folder.load_checkpoint(run_dir / "checkpoint" / f"step_{step - 1}", trained)
    batch, mine = train.sample(run, step)
    G, texts = cfg.group_size, batch.texts(run.tokenizer)

    # the reward of `text` answering batch row b (its data row's fields too)
    def score(text: str, b: int) -> float:
        row = run.rows[mine[b // G]]
        return reward.rewards([text], [row["answer"]], cfg.reward, [row])[0]  # as train.py calls it

    rewards = torch.tensor([score(text, i) for i, text in enumerate(texts)])  # (B,)
    replay = Replay(batch, cfg, step)
    pi_old = {name: x.detach().clone() for name, x in run.policy.state_dict().items()}
    # the same rollout again (seeded), then the step's updates, watched
    train.train_step(run, step, replay)
    run.policy.load_state_dict(pi_old)
    k, sizes, logprobs, entropy, mask, silenced, candidates, rule = zip(*replay.seen)
    matches = _matches_run(run_dir, step, cfg, rewards, batch, texts,
                           sum(int(x.sum()) for x in candidates),
                           sum(int(x.sum()) for x in silenced))
    return Step(cfg, run.tokenizer, run.policy, run.engine,
                [ids[m.bool()].tolist() for ids, m in zip(batch.prompt_ids, batch.prompt_mask)],
                [ids[m.bool()].tolist() for ids, m in zip(batch.response_ids, batch.response_mask)],
                [run.rows[mine[i // G]]["answer"] for i in range(len(batch))],
                [mine[i // G] for i in range(len(batch))],
                [j for j, n in zip(k, sizes) for _ in range(n)], score, rewards,
                stapo.group_advantages(rewards, G),
                *(torch.cat(x) for x in (logprobs, entropy, mask)),
                *(torch.cat(x).bool() for x in (silenced, candidates, rule)), matches)


def _matches_run(run_dir: Path, step: int, cfg, rewards, batch, texts: list[str], candidates: int,
                 silenced: int) -> bool | None:
    """Whether a regenerated step is the run's (config `cfg`): its mean reward, length and S2T
    candidate and silenced counts against the step's metrics.jsonl line, and the first response of
    its first prompts against samples.jsonl (None: the run never made the step; D64)."""
    G, n_samples = cfg.group_size, cfg.samples_per_step
    line = next((m for m in run_folder.read_log(run_dir / "metrics.jsonl")
                 if m["step"] == step), None)
    if line is None:
        return None
    samples = [s["response"] for s in run_folder.read_log(run_dir / "samples.jsonl")
               if s["step"] == step and s["split"] == "train"]
    return (math.isclose(line["reward/mean"], rewards.mean().item(), abs_tol=1e-6)
            and math.isclose(line["response/len_mean"],
                             batch.response_mask.sum(1).float().mean().item(), abs_tol=1e-4)
            and (line["s2t/candidates"], line["s2t/silenced"]) == (candidates, silenced)
            and samples == texts[::G][:min(n_samples, len(samples))])


def analyse_step(st: Step, step: int, k: int, n_tokens: int, seed: int, prefixes_per_call: int,
                 delta: float) -> list[dict]:
    """counterfactual.jsonl lines of `n_tokens` tokens of each kind of one regenerated step; a token
    is negligible when its contrast's interval lies inside (-delta, delta)."""
    cfg, tok = st.cfg, st.tokenizer
    gen = torch.Generator().manual_seed(hash((seed, step)) % 2**62)
    picked = pick_tokens(st.silenced, st.candidates, st.response_mask, st.rewards > 0,
                         n_tokens, gen)
    sample = engine_sampler(st.engine, cfg.temperature, cfg.top_p)

    def grade(row: int, response: list[int]) -> float:
        return st.score(tok.decode(response, skip_special_tokens=True), row)

    with st.engine.ready(st.policy):
        effects = token_effects(sample, grade, list(zip(st.prompts, st.responses)),
                                [(r, t) for _, r, t in picked], k, cfg.max_response_len,
                                hash((seed, step, 1)) % 2**62, prefixes_per_call)
    lines, graded = [], {}
    for (kind, row, t), e in zip(picked, effects):
        y = st.responses[row]
        if row not in graded:
            graded[row] = reward.graded_count(tok, y, cfg.reward)
        lines.append({
            "algo": cfg.algo, "seed": cfg.seed, "step": step, "kind": kind, "effect": e.effect,
            "stderr": e.stderr, "k": e.k, "keep": e.keep, "resample": e.resample,
            "exclude": e.exclude, "contrast": e.contrast, "contrast_ci": list(e.contrast_ci),
            "negligible": -delta < e.contrast_ci[0] and e.contrast_ci[1] < delta, "delta": delta,
            "part": "graded" if t < graded[row] else "after", "row": row, "t": t,
            "token": tok.decode([y[t]]), "context": tok.decode(y[max(0, t - 12):t]),
            "after": tok.decode(y[t + 1:t + 13]), "p": math.exp(float(st.logprobs[row, t])),
            "H": float(st.entropy[row, t]), "candidate": bool(st.candidates[row, t]),
            "s2t_rule": bool(st.s2t_rule[row, t]), "A": float(st.advantages[row]),
            "reward": float(st.rewards[row]), "response_len": len(y),
            "data_index": st.data_index[row], "mini_batch": st.mini_batch[row],
            "rollout_matches_run": st.matches_run})
    return lines


# ------------------------------------------------------------------------------------- command line
@dataclass
class Config:
    """Estimate each token's causal effect on the reward (RQ2) for tokens a training step silenced,
    the candidates it kept and other tokens of correct responses: python -m tools.counterfactual RUN
    [flags]. Writes RUN/counterfactual.jsonl and prints the summary per kind."""
    steps: list[int] = field(default_factory=lambda: [1])
    """steps to analyse (from 1): step s needs the policy after step s - 1,
    RUN/checkpoint/step_<s - 1> (step 1: the initial model)"""
    k: int = 32
    """continuations per prefix (each token: K with it kept, K with its position redrawn)"""
    tokens: int = 16
    """tokens of each kind (silenced, candidate, other) drawn per step, at most"""
    seed: int = 0
    """seed of the token draw and the continuations"""
    prefixes_per_call: int = 16
    """prefixes sampled per generate call (x K rows)"""
    delta: float = 0.2
    """equivalence margin: a token is negligible when the 95% interval of its contrast lies inside
    (-delta, delta); with K draws a side the interval is at least +-(1 - Wilson's lower bound at K
    of K) wide (K 16: 0.19, 32: 0.11)"""
    plot: bool = False
    """also draw RUN/counterfactual.png (needs matplotlib)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--table":
        return table(argv[1:])
    if not argv or argv[0].startswith("-"):
        if "-h" in argv or "--help" in argv:
            flags.parse_flags(Config, argv, "tools.counterfactual RUN")
        return errors.error("tools.counterfactual", "give a train.py run folder first: "
                            "python -m tools.counterfactual RUN [flags]")
    run_dir, cfg = Path(argv[0]), Config(**flags.parse_flags(Config, argv[1:],
                                                             "tools.counterfactual RUN"))
    if not (run_dir / "config.json").is_file():
        return errors.error("tools.counterfactual",
                            f"{run_dir} is not a train.py run folder (no config.json)")
    lines, owned = [], not torch.distributed.is_initialized()
    try:
        for step in cfg.steps:
            st = regenerate_step(run_dir, step)
            if st.matches_run is False:
                print(f"tools.counterfactual: warning: the regenerated rollout of step {step} "
                      f"differs from the run's logs (run this with the run's OMP_NUM_THREADS; a "
                      f"run of several processes needs --rollout-chunk 1): the same policy's "
                      f"rollout is analysed, not the run's tokens", file=sys.stderr)
            t0 = time.time()
            new = analyse_step(st, step, cfg.k, cfg.tokens, cfg.seed, cfg.prefixes_per_call,
                               cfg.delta)
            print(f"step {step}: {len(new)} tokens in {time.time() - t0:.0f} s "
                  f"({(time.time() - t0) / max(len(new), 1):.1f} s per token, K = {cfg.k})",
                  flush=True)
            lines += new
            st.engine.close()
    except (FileNotFoundError, ValueError) as e:
        return errors.error("tools.counterfactual", e)
    finally:
        if owned and torch.distributed.is_initialized():  # the 1-process group regenerate_step made
            torch.distributed.destroy_process_group()
    out = run_dir / "counterfactual.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"{out}: {len(lines)} tokens, K = {cfg.k}, steps {', '.join(map(str, cfg.steps))}\n"
          f"{summary(lines)}")
    if cfg.plot:
        figures.plot_counterfactual(lines, str(run_dir / "counterfactual.png"))
    return 0


def table(argv: list[str]) -> int:
    """`python -m tools.counterfactual --table RUN [RUN ...] [--out PNG]`: the counterfactual.jsonl
    of several runs pooled, per algorithm (`pooled_summary`), and with --out their figure
    (figures.plot_counterfactual_groups)."""
    out = argv[argv.index("--out") + 1] if "--out" in argv[:-1] else None
    runs = list(dict.fromkeys(a for i, a in enumerate(argv)
                              if a != "--out" and (i == 0 or argv[i - 1] != "--out")))
    missing = [r for r in runs if not (Path(r) / "counterfactual.jsonl").is_file()]
    if not runs or missing or any(r.startswith("-") for r in runs):
        why = f" (no counterfactual.jsonl in {', '.join(missing)})" if missing else ""
        return errors.error("tools.counterfactual", f"--table RUN [RUN ...] [--out PNG] needs runs "
                            f"analysed by tools/counterfactual.py{why}")
    lines = [x for run in runs for x in run_folder.read_log(Path(run) / "counterfactual.jsonl")]
    print(pooled_summary(lines))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    if out and figures.plot_counterfactual_groups(pooled_groups(lines), out, cluster_interval):
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
