"""What a run is told (docs/paper.md §6, the recipe; docs/training.md): train.py's `Config`, whose
fields (with the string under each as its --help) become the flags, the presets, and the values in
effect on this machine; and train.py's first checks of them against the processes and the data.
The flag builder and --config files are command_line/flags.py.

    cfg, recorded, notes = parse_config(argv)
        # train.py: flags, preset, a resumed run's config.json
    train_rows, heldout_rows = read_inputs(cfg, world)  # every rank, before the model loads

No torch at import (parse_config and read_inputs import torch and the files whose rules they
check, stapo.py, reward.py, run_folder, when they run), so that `eval.py --help` answers at once;
train.py is never imported: tools that need a Config import this file. Deliberate differences
D47-D51: docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from command_line.errors import check_writable
from command_line.flags import check_values, parse_flags
from data import INSTRUCTION, builtin_task, load_rows, repeated_note
from model_files.names import check_model_name


@dataclass
class Config:
    """RL-train a causal LM with STAPO or a baseline (defaults: with CUDA the paper's recipe,
    docs/paper.md §6; without CUDA the cpu preset, whose values the flags below name). Or, instead
    of training: `python train.py --plot RUN [RUN ...] [--out PNG]` redraws the figures of finished
    runs, overlaid (RUN/metrics.png and RUN/s2t.png for one run, FIRST_RUN/compare.png and
    compare_s2t.png for several; --out X.png: X.png and X_s2t.png)."""
    preset: str = "auto"
    """auto | paper | cpu: auto = paper with CUDA, cpu without; flags given on the command line
    override it"""
    model: str = "Qwen/Qwen3-1.7B-Base"
    """Hub id, local HF dir, .gguf file, 'smollm2' (packaged SmolLM2-135M-Instruct), 'tiny'/'tiny64'
    (random, tests)"""
    data: str = "BytedTsinghua-SIA/DAPO-Math-17k"
    """Hub dataset id or local .jsonl/.json/.parquet file; '' = the built-in arithmetic task"""
    split: str = "train"
    """dataset split (Hub ids)"""
    prompt_key: str = "prompt"
    """field of the problem text (a dotted path for nested fields; a chat message list uses its last
    user turn)"""
    answer_key: str = "reward_model.ground_truth"
    """field of the gold answer (dotted path); a string or a list of strings"""
    heldout: int | None = None
    """rows of --data kept out of training and evaluated before and after it; default (none): a
    tenth of the rows, at most 20, none below 10 rows (data.heldout_count); 0 = none. The built-in
    task has its own 20"""
    instruction: str = INSTRUCTION
    """text appended to every problem (default: the paper's \\boxed{} instruction,
    rollout.INSTRUCTION)"""
    chat: bool = True
    """format prompts with the tokenizer's chat template (--no-chat: raw text, e.g. for tiny
    models)"""
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
    """tokens per forward/backward on each rank, counted as its rows' prompt + response tokens (no
    padding, as verl's dynamic batch size): the rows of a prompt together, a longer row
    alone, 1 = one row at a time (gradient accumulation: changes memory, not the update)"""
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
    """dual clip constant c > 1 for A < 0 (veRL's clip_ratio_c, 10 in the paper's JustRL scripts);
    none = off"""
    tau_p: float = 0.002
    """S2T probability threshold"""
    quantile: float = 0.75
    """S2T entropy quantile q over the candidates of the mini-batch"""
    quantile_window: int = 0
    """S2T: tau_h is the quantile over the mini-batch's candidates and the last N candidates of the
    mini-batches before it (all ranks; 0 = the paper's rule, the mini-batch alone): a declared
    deviation for mini-batches that hold a handful of candidates (docs/paper.md)"""
    kl_beta: float = 0.0
    """GRPO only: weight of the k3 KL to the initial model (0 = no reference model)"""
    reward: str = "dapo"
    """dapo (+1/-1 by reward.grade), binary (1/0), strict (normalized last-box string match), or
    your own function FILE.py:FUNCTION or MODULE:FUNCTION, called as FUNCTION(response, answer,
    **the row's fields it names) -> a finite number, or batched (reward.py, "your own reward";
    examples/reward_last_line.py, reward_with_row.py); a positive reward counts as correct
    (reward/acc, held-out accuracy)"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are dropped"""
    max_response_len: int = 15360
    """max new tokens per response"""
    stop_text: list[str] = field(default_factory=list)
    """a response also ends with the token at which this text first appears in it, as vLLM's `stop`
    (repeatable); that token stays in the response and the reward reads all of it. A blank line in a
    shell: --stop-text $'\\n\\n'"""
    temperature: float = 1.0
    """sampling temperature (also divides the logits of the training forward)"""
    top_p: float = 1.0
    """nucleus sampling"""
    rollout: Literal["auto", "plain", "vllm"] = "auto"
    """auto | plain | vllm: rollout engine (vllm: a colocated vLLM engine fed with the policy's
    weights; docs/rollouts.md); auto = vllm on CUDA when vllm is installed, else plain (config.json
    records which)"""
    kv_cache_gb: float = 40.0
    """KV-cache budget per rank in GB (worst case: every row at max prompt + response length):
    bounds the plain sampler's prompts per generate call (--rollout-chunk 0) and is vLLM's KV cache
    (at most what the rollout needs)"""
    rollout_chunk: int = 0
    """prompts per generate call on each rank (0 = the most that fit --kv-cache-gb); 1 makes
    rollouts independent of the number of ranks"""
    cuda_graphs: bool = False
    """--rollout plain on CUDA: decode through one CUDA graph per batch bucket
    (cuda_graphs.CapturedStep); off until a GPU run of `python -m tools.bench gpu` has checked it
    (docs/gpu.md)"""
    collective_timeout_min: float = 60.0
    """minutes a rank waits in a collective for the others before the run fails (ranks whose
    rollouts are longer finish later; NCCL's default is 10)"""
    stop_deadline_s: float = 240.0
    """seconds from a stop signal after which a rank that has not stopped (a frozen rank holds the
    others) leaves with exit status 75, keeping the last complete checkpoint; under the job's grace
    period (SLURM --signal=USR1@300: 300), above a checkpoint write; 0 = wait for every rank"""
    tis_cap: float | None = None
    """truncated importance sampling: weight tokens by min(pi_old / pi_sampler, cap) (e.g. 2 with
    --rollout vllm); default off"""
    chunk_size: int = 1024
    """tokens per LM-head chunk in the log-prob/entropy pass"""
    fsdp: bool = False
    """shard with FSDP2 also on one CPU process (always on with several processes or on CUDA;
    config.json records whether the model was sharded)"""
    mixed_precision: bool = True
    """bf16 compute with fp32 master weights and gradient reduction (CUDA only; config.json records
    false without CUDA)"""
    grad_checkpointing: bool = True
    """recompute each decoder layer's activations in the backward: per token it keeps each layer's
    input instead of all its activations (Qwen3-1.7B: 13x less activation memory), for ~1/3 more
    update compute"""
    eval_every: int = 0
    """evaluate the held-out problems every N steps (0 = before and after training only, when there
    are any)"""
    eval_before: bool = True
    """evaluate the held-out set before training (--no-eval-before: not, e.g. in runs whose
    evaluation before training another run of the same seed and initial model has made: it samples
    the same, eval.jsonl step 0)"""
    eval_samples: int = 4
    """samples per held-out problem (at --temperature); 0 = no held-out evaluation"""
    entropy_change: bool = False
    """after each optimizer step, a no-grad forward over the same mini-batch: log the mean entropy
    change at silenced tokens, kept candidates and other tokens (entropy_change/* in metrics.jsonl;
    one more forward per update), and the logit-gradient norm, tokens and entropy change per kind of
    token and part of the response (shares/*)"""
    gradient_share: bool = False
    """in each mini-batch that holds candidates (A > 0, p < tau_p) the algorithm keeps, one more
    forward and backward over their terms alone: log the parameter-gradient norm of the whole
    objective, of the candidates' terms and of the rest (grad_share/* in metrics.jsonl; norms of
    sums, so cancellation counts); the update is unchanged"""
    spurious_per_step: int = 20
    """silenced tokens written to OUT/spurious.jsonl per step"""
    samples_per_step: int = 4
    """completions (prompt, response, reward) written to OUT/samples.jsonl per step and per held-out
    evaluation"""
    token_sample: int = 128
    """response tokens per mini-batch and rank drawn into OUT/tokens.jsonl for the S2T figure: every
    candidate and silenced token (at most this many) plus this many others at random (0 = none)"""
    seed: int = 0
    """seed of data order, sampling and initialization (any 64-bit integer)"""
    out_dir: str = "out/train"
    """output folder: config.json, metrics.jsonl, eval.jsonl, samples.jsonl, spurious.jsonl,
    tokens.jsonl, checkpoint/, hf/, metrics.png, s2t.png"""
    save_every: int = 50
    """also write a sharded checkpoint every N steps (0 = only at the last step, which always writes
    one, so every finished run can be resumed)"""
    keep_checkpoints: int = 2
    """complete checkpoints kept (the newest; 2 leaves one to fall back to if the newest is found
    damaged)"""
    save_optimizer: bool = True
    """keep AdamW's moments in checkpoints (--no-save-optimizer: weights only, ~1/3 of the size; a
    resume then restarts AdamW from zero moments, with a warning)"""
    resume: str = ""
    """RUN: continue the run in the folder RUN from its newest verified checkpoint, with its config
    (only the flags of run_folder.RESUMABLE may change; a change is recorded in RUN/resumes.jsonl);
    auto: continue the run in --out-dir if it holds a checkpoint, else start it there with the flags
    given (the same command line for the first attempt and every requeue or restart)"""
    overwrite: bool = False
    """replace the run already in --out-dir: its logs, checkpoints and export are deleted when
    training starts (without it, a folder that holds a run is refused)"""
    export_hf: bool = True
    """write a Hugging Face-format model to OUT/hf at the end"""
    light: bool = False
    """little disk for small experiments: sets --no-export-hf --no-save-optimizer
    --keep-checkpoints 1 --save-every 0 (config.LIGHT; flags given win): one weights-only
    checkpoint, at the last step or a stop (SmolLM2: 0.54 GB instead of 2.2 GB);
    python train.py --resume OUT --export-hf exports it later"""
    plots: bool = True
    """write this run's figures OUT/metrics.png, s2t.png and gradient.png at its end (needs
    matplotlib; --plot RUN [RUN ...], not this flag, redraws and overlays finished runs)"""
    logger: str = ""
    """live curves of the metrics.jsonl and eval.jsonl keys: '' (none), tensorboard
    (OUT/tensorboard; pip install tensorboard) or wandb (pip install wandb; WANDB_MODE=offline works
    without network)"""


# The embedded default for machines without a GPU (`--preset cpu`): SmolLM2-135M-Instruct on
# builtin_task, sized so `python train.py` (2.5 min) and
# `torchrun --standalone --nproc_per_node=2 train.py` (6 min) finish in < 15 minutes on 2 idle
# cores, and S2T silences tokens in most steps (docs/training.md, Time).
CPU_PRESET = dict(  # D47
    model="smollm2", data="", chat=False, instruction="The answer is", temperature=1.0,
    max_response_len=24, steps=10, prompts_per_step=16, mini_batch_prompts=8, lr=3.5e-6,
    warmup_steps=0, grad_checkpointing=False, rollout_chunk=0, save_every=0, keep_checkpoints=1,
    eval_samples=4, out_dir="out/train-cpu",
)


# train.py --plot's line in --help (reports.report.main parses the rest)
PLOT_HELP = ("redraw the figures of finished runs, RUN/metrics.png, s2t.png and gradient.png "
             "(several runs: overlaid), and print RQ1's correlations, without training (not "
             "--plots, which draws this run's at its end); `python train.py --plot RUN --help` "
             "lists --out, --table and --sensitivity")


# --light: what a small experiment keeps on disk (one weights-only checkpoint, no export);
# flags given win.
LIGHT = dict(export_hf=False, save_optimizer=False, keep_checkpoints=1, save_every=0)


def parse_config(argv: list[str] | None = None) -> tuple[Config, dict | None, list[str]]:
    """argv -> (Config, the resumed run's recorded config or None for a new run, warnings for rank 0
    to print). Each field is a --flag (`parse_flags`: underscores -> dashes, the string under it is
    its --help). Values: the flags given, else (resuming) the run's config.json, else the preset's
    (CPU_PRESET or Config). Every value is checked here; the run folder is only read (its
    config.json and which checkpoints it holds)."""
    import reward  # these load torch: here, not with this file
    import run_folder
    import stapo
    import torch

    given = parse_flags(Config, argv, "train.py",
                        notes={k: f"cpu preset: {v!r}" for k, v in CPU_PRESET.items()},
                        modes={"plot": PLOT_HELP})  # --plot: train.main calls report.main first
    if given.get("light"):
        given = {**LIGHT, **given}
    cuda = torch.cuda.is_available()
    preset = given.get("preset", "auto")
    if preset == "auto":
        preset = "paper" if cuda else "cpu"  # D38
    if preset not in ("paper", "cpu"):
        raise ValueError(f"unknown --preset {preset!r}; valid: auto, paper, cpu")
    defaults = CPU_PRESET if preset == "cpu" else {}
    resume = given.get("resume", "")
    if resume and given.get("overwrite"):
        raise ValueError("--overwrite starts a new run in --out-dir; "
                         "it cannot be combined with --resume")
    if resume not in ("", "auto"):  # --resume RUN: the run in its own folder
        if "out_dir" in given and Path(given["out_dir"]) != Path(resume):
            raise ValueError(f"--resume continues the run in its own folder {resume}; "
                             f"--out-dir cannot move it")
        given["out_dir"] = resume
    out = given.get("out_dir", defaults.get("out_dir", Config.out_dir))
    if not out.strip():  # Path("") is the working directory
        raise ValueError("--out-dir '' names no folder: give one, e.g. --out-dir out/run")
    # a newline would split every console line that names it
    if any(ord(c) < 32 or ord(c) == 127 for c in out):
        raise ValueError(f"--out-dir {out!r} holds a control character: "
                         f"name the folder without one")
    out = Path(out)
    # --resume RUN, or --resume auto in a folder with a complete checkpoint: the run's recipe
    recorded = None
    if resume and (resume != "auto" or run_folder.complete_steps(out)):
        recorded = check_values(Config, run_folder.recorded_config(out),
                                str(out / "config.json"))  # hand edits too
        if not run_folder.complete_steps(out):
            raise FileNotFoundError(
                f"{out} has no checkpoint to resume from: the run stopped before its first one "
                f"(written every --save-every steps, at a stop by signal and at the last step); "
                f"start it again with {run_folder.again(out)} (or replace it with --overwrite)")
    cfg = Config(**({**recorded, **given} if recorded else {**defaults, **given, "preset": preset}))
    # an unknown mode or a broken FILE.py:FUNCTION: one line now, not in step 1
    reward.load_reward(cfg.reward)
    stapo.algorithm(cfg.algo)  # an unknown --algo: one line naming the valid ones
    for name, low in _AT_LEAST.items():
        if getattr(cfg, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low} "
                             f"(got {getattr(cfg, name)})")
    if cfg.temperature <= 0:
        raise ValueError("--temperature must be > 0 "
                         "(the training forward divides the logits by it)")
    for name, ok, rule in (("top_p", 0 < cfg.top_p <= 1, "in (0, 1]"),
                           ("tau_p", 0 < cfg.tau_p <= 1, "in (0, 1]"),
                           ("quantile", 0 <= cfg.quantile <= 1, "in [0, 1]"),
                           ("grad_clip", cfg.grad_clip > 0, "> 0"),
                           ("dual_clip", cfg.dual_clip is None or cfg.dual_clip > 1, "> 1"),
                           ("kv_cache_gb", cfg.kv_cache_gb > 0, "> 0"),
                           ("heldout", cfg.heldout is None or cfg.heldout >= 0, ">= 0"),
                           ("collective_timeout_min", cfg.collective_timeout_min > 0, "> 0"),
                           ("tis_cap", cfg.tis_cap is None or cfg.tis_cap > 0, "> 0"),
                           ("seed", -2**63 <= cfg.seed < 2**63, "a 64-bit integer"),
                           # its candidates' entropies are kept in memory, 4 bytes each
                           ("quantile_window", cfg.quantile_window <= 10**9, "<= 10**9")):
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')} must be {rule} "
                             f"(got {getattr(cfg, name)})")
    if not all(cfg.stop_text):
        raise ValueError("--stop-text '' would end every response at once: give a non-empty text")
    if cfg.prompts_per_step % cfg.mini_batch_prompts:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is not a multiple of "
                         f"--mini-batch-prompts {cfg.mini_batch_prompts}")
    # a float flag must be a finite float32 (AdamW computes in float32: --lr 1e39 overflows)
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not (math.isfinite(value)
                                             and abs(value) <= torch.finfo(torch.float32).max):
            raise ValueError(f"--{f.name.replace('_', '-')} {value} is not a finite float32")
    # torchrun's env:// contract: WORLD_SIZE is set before the process group exists
    cfg, notes = in_effect(cfg, given, cuda, int(os.environ.get("WORLD_SIZE", 1)))
    if recorded:
        run_folder.resume_changes(recorded, asdict(cfg))  # raises for a change of recipe
    try:  # rank 0 writes into it; every rank writes its checkpoint shards
        check_writable("--out-dir", out)
    except OSError:
        if not (recorded and run_folder.finished_read_only(out, asdict(cfg))):
            raise
    return cfg, recorded, notes


# Lower bounds of the integer (and a few float) flags, checked before anything loads.
_AT_LEAST = dict(steps=1, prompts_per_step=1, group_size=2, mini_batch_prompts=1,
                 max_tokens_per_micro_batch=1, lr=0, warmup_steps=0, weight_decay=0, kl_beta=0,
                 max_prompt_len=1, max_response_len=1, rollout_chunk=0, chunk_size=1, eval_every=0,
                 eval_samples=0, spurious_per_step=0, samples_per_step=0, quantile_window=0,
                 save_every=0, keep_checkpoints=1)


def in_effect(cfg: Config, given: dict, cuda: bool, world: int) -> tuple[Config, list[str]]:
    """The config the run actually uses, which config.json records, and the lines for rank 0 to
    print: a warning for each flag given on the command line that has no effect on this machine or
    with these settings (stored as in effect; D51), a note where --rollout auto could not choose
    vLLM on CUDA."""
    notes, rollout_engine = [], cfg.rollout
    if cfg.rollout == "auto":  # vLLM where it pays (CUDA) and is installed
        rollout_engine = ("vllm" if cuda and importlib.util.find_spec("vllm") is not None
                          else "plain")
        if cuda and rollout_engine == "plain":
            notes.append("note: --rollout auto samples with the plain sampler, since vllm is not "
                         "installed (pip install vllm==0.32.0: far faster at the paper's lengths; "
                         "docs/rollouts.md)")
    effective = {"rollout": rollout_engine, "fsdp": cfg.fsdp or world > 1 or cuda,
                 "mixed_precision": cfg.mixed_precision and cuda,
                 "kl_beta": cfg.kl_beta if cfg.algo == "grpo" else 0.0,
                 "heldout": cfg.heldout if cfg.data else len(builtin_task("test")),
                 "eval_every": cfg.eval_every
                 if (not cfg.data or cfg.heldout != 0) and cfg.eval_samples else 0}
    why = {"mixed_precision": "without CUDA (compute is fp32)",
           "kl_beta": f"with --algo {cfg.algo} (GRPO only)",
           "heldout": "with the built-in task (it has its own 20 held-out problems)",
           "eval_every": "without a held-out evaluation (--heldout 0 or --eval-samples 0)"}
    for name, reason in why.items():
        if name in given and given[name] != effective[name]:
            notes.append(f"warning: --{name.replace('_', '-')} {given[name]} has no effect "
                         f"{reason}; config.json records {name} = {effective[name]!r}")
    return replace(cfg, **effective), notes


# ---------------------------------------------------------------------------- train.py's inputs
def read_inputs(cfg: Config, world: int) -> tuple[list[dict], list[dict]]:
    """The checks that need neither the model nor the run folder, made first (every rank): the
    number of processes, the logger, --model (a name that is not there: at once, model_files/
    names.py), the data -> (training rows, held-out rows) of data.load_rows."""
    import torch.distributed as dist

    import run_folder

    if cfg.prompts_per_step % world or cfg.mini_batch_prompts % world:
        raise ValueError(f"--prompts-per-step and --mini-batch-prompts must be multiples of the "
                         f"{world} ranks")
    run_folder.check_logger(cfg.logger)
    check_model_name(cfg.model)
    train_rows, test_rows, repeated = load_rows(cfg)
    if repeated and dist.get_rank() == 0:
        note = repeated_note(cfg.data, repeated, len(train_rows) + len(test_rows))
        print(f"train.py: note: {note}", file=sys.stderr, flush=True)
    too_few(cfg, len(train_rows))
    return train_rows, test_rows


def run_record(cfg: Config, rows: tuple[list[dict], list[dict]]) -> dict:
    """The values in effect of a run reading `rows` (read_inputs'), which config.json records
    (run_folder.recipe): `heldout` is the number of rows it holds out and evaluates (not --heldout's
    null, the default share), from which a resume rebuilds the same rows."""
    return {**asdict(cfg), "heldout": len(rows[1])}


def too_few(cfg: Config, n_rows: int) -> None:
    """A step takes each training problem at most once: refuse --prompts-per-step above the problems
    there are."""
    if cfg.prompts_per_step > n_rows:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is more than the {n_rows} "
                         f"training problems of {cfg.data or 'the built-in task'} (a step takes "
                         f"each at most once): lower it")
