"""train.py's held-out evaluation during a run (docs/paper.md §7, the protocol; §6, the recipe):
--eval-samples samples of each held-out problem, graded by the training reward, their mean accuracy
and length written to eval.jsonl (`evaluate_heldout`). Each problem is one generate call seeded by
the problem, as eval.py's `heldout` set samples it, so `eval.py --run` reports the same numbers.
It imports nothing of eval.py, so train.py, which imports it, never loads eval.py."""
from __future__ import annotations

from pathlib import Path

import reward
from data import problem_seed


def evaluate_heldout(run, done: int) -> bool:
    """train.py's held-out evaluation of `run` (a train.Run) after `done` steps, written to
    eval.jsonl; False when a stop signal came during it (nothing is written: the resume evaluates
    again)."""
    import run_folder
    from distributed.process_group import gather
    result, samples = heldout_accuracy(run, done)
    if result is None:
        return False
    run_folder.write_logs(Path(run.cfg.out_dir), {
        "eval.jsonl": [{"step": done, **result}],
        "samples.jsonl": gather(samples)[:run.cfg.samples_per_step]}, run.rank, run.logger)
    when = f"after {run_folder.plural(done, 'step')}" if done else "before training"
    run_folder.say(f"held-out accuracy {when}: {result['eval/acc']:.4f} = "
                   f"{100 * result['eval/acc']:.2f}% as eval.py reports it "
                   f"({run_folder.plural(int(result['eval/n']), 'sample')})", run.rank)
    return True


def heldout_accuracy(run, done: int) -> tuple[dict | None, list[dict]]:
    """Mean accuracy over --eval-samples samples per held-out problem after `done` steps, and this
    rank's samples.jsonl records; (None, []) when a stop signal came during it. Each problem is one
    generate call seeded by the problem (data.problem_seed of --seed + 1 and its index) and the
    ranks hold consecutive shares, so the results and the records (gathered in rank order) are the
    same on any number of processes."""
    from distributed.process_group import all_sum, gather
    from step_metrics.step_log import completions
    cfg, prompts = run.cfg, run.test_prompts
    rank_rows = list(range(len(prompts) * run.rank // run.world,
                           len(prompts) * (run.rank + 1) // run.world))
    correct = total = length = 0.0
    samples = []
    run.policy.eval()
    with run.engine.ready(run.policy):  # a collective: every rank enters, also one without problems
        out = run.engine.sample([prompts[i] for i in rank_rows], cfg.eval_samples,
                                [problem_seed(cfg.seed + 1, i) for i in rank_rows], 1,
                                cfg.max_response_len, cfg.temperature,
                                cfg.top_p) if rank_rows else None
    if run.preemption.agreed():  # a stop signal came during it
        return None, []
    if rank_rows:
        texts = out.texts(run.tokenizer)
        rows = [run.test_rows[rank_rows[j // cfg.eval_samples]] for j in range(len(texts))]
        # the training reward; correct: a positive reward
        rewards = reward.rewards(texts, [r["answer"] for r in rows], cfg.reward, rows)
        verdicts = [float(r > 0) for r in rewards]
        correct, total, length = sum(verdicts), len(texts), float(out.response_mask.sum())
        samples = completions(run, done, "heldout", texts, rewards, rank_rows, cfg.eval_samples)
    S = cfg.eval_samples
    per_problem = [(row, int(sum(verdicts[j * S:(j + 1) * S])))
                   for j, row in enumerate(rank_rows)] if rank_rows else []
    correct, total, length = all_sum(correct, total, length)
    return {"eval/acc": correct / max(total, 1), "eval/len_mean": length / max(total, 1),
            "eval/n": total,  # eval/correct: correct samples per problem
            "eval/correct": [n for _, n in sorted(gather(per_problem))]}, samples

