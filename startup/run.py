"""The run train.py steps (docs/training.md; the recipe of docs/paper.md §6): `Run`, a run's state
between steps, and `setup`, which builds it: the model read once (several processes: on rank 0,
sharded to the others), the prompts that fit --max-prompt-len, the policy and GRPO's reference
model sharded with FSDP2, AdamW with its warm-up, the checkpoint a resume continues from, the
rollout engine and the --logger."""
from __future__ import annotations

import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import config
import rollout
import run_folder
import s2t
from distributed.sharding import from_rank0, shard_policy
from engines.choice import compute_dtype, prompts_per_call, rollout_engine
from memory.allocator import keep_freed_memory
from memory.estimate import memory_line, run_estimate
from model import Policy, lm_vocab_size, load_model


@dataclass
class Run:
    """A run's state between steps (`setup` makes it): the configuration, the process, the models,
    the data."""
    cfg: config.Config
    rank: int
    world: int
    device: torch.device
    policy: Policy
    ref_policy: Policy | None  # GRPO's reference model (--kl-beta > 0), else None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: object  # the rollout engine (engines.make_engine)
    rows: list[dict]  # training problems {"problem", "answer"} (data.py), their prompts (token ids)
    prompts: list[list[int]]
    test_rows: list[dict]  # held-out problems and their prompts
    test_prompts: list[list[int]]
    preemption: run_folder.Preemption  # stop signals (SIGTERM, SIGUSR1) on any rank
    logger: run_folder.Logger | None  # --logger (rank 0)
    start: int = 0  # steps already done (a resumed run)
    window: s2t.QuantileWindow | None = None  # --quantile-window's earlier candidates


def setup(cfg: config.Config, rows: tuple[list[dict], list[dict]], rank: int, world: int, device,
          checkpoint: Path | None, preemption: run_folder.Preemption) -> Run:
    """The model, its sharding, the optimizer, the rollout engine, and the checkpoint a resume
    continues from."""
    run_folder.quiet_library_bars()  # transformers' "Loading weights", "Writing model shards"
    if device.type == "cpu":
        keep_freed_memory()
        # Deterministic kernels: without them the backward on several threads sums in a varying
        # order, so two runs of one command at 2 threads, or a run and its resume, differ from the
        # first update on (docs/training.md, Reproducibility). CUDA keeps its fast kernels.
        torch.use_deterministic_algorithms(True, warn_only=True)
    # one process: read onto its device; several: read once on rank 0, the others build it on the
    # meta device and receive their shards of the weights from rank 0 in shard_policy
    # (sharding.from_rank0)
    load = (lambda: load_model(cfg.model, device=device)) if world == 1 else (lambda: from_rank0(
        lambda: load_model(cfg.model)))
    lm, tokenizer = load()
    if cfg.chat and not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {cfg.model!r} has no chat template; use --no-chat")
    train_rows, train_prompts, test_rows, test_prompts = fitting(cfg, tokenizer, rows, rank)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if rank == 0:  # the memory model's estimate (docs/memory.md), every row at its longest
        per_call = prompts_per_call(cfg, cfg.prompts_per_step // world, lm.config,
                                    compute_dtype(cfg, device).itemsize)
        longest = max(map(len, train_prompts))
        print(memory_line(run_estimate(cfg, lm.config, world, longest, per_call),
                          per_call * cfg.group_size, longest + cfg.max_response_len), flush=True)

    def make_policy(model_lm):
        policy = Policy(model_lm, vocab_size=lm_vocab_size(tokenizer))  # the sampler's rows only
        if cfg.grad_checkpointing:
            model_lm.gradient_checkpointing_enable({"use_reentrant": False})
        if cfg.fsdp:  # in_effect: on with several processes or CUDA
            shard_policy(policy, mixed_precision=cfg.mixed_precision, from_rank0=world > 1,
                         device=device)
        return policy

    policy = make_policy(lm)
    ref_policy = None
    if cfg.algo == "grpo" and cfg.kl_beta > 0:
        ref_policy = make_policy(load()[0]).requires_grad_(False)
    # fused: one kernel over all parameters (CPU: 4-5x faster than the foreach loop at SmolLM2's
    # 135M, python -m tools.bench flops)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=True)
    # lr: linear warm-up over warmup_steps optimizer steps, then constant
    warmup = lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    start, window = 0, None
    if checkpoint is not None:  # any number of ranks: DCP reshards (run_folder.load_checkpoint)
        trained = run_folder.ModelAndOptimizer(policy, optimizer, scheduler)
        start, window = run_folder.resume(checkpoint, trained, cfg.steps, rank)
    engine = rollout_engine(cfg, lm, tokenizer, train_prompts + test_prompts, rank, world, device,
                            preemption.requested)  # the plain sampler stops at a signal
    logger = run_folder.open_logger(cfg.logger, Path(cfg.out_dir), asdict(cfg)) if rank == 0 \
        else None
    return Run(cfg=cfg, rank=rank, world=world, device=device, policy=policy, ref_policy=ref_policy,
               tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, engine=engine,
               rows=train_rows, prompts=train_prompts, test_rows=test_rows,
               test_prompts=test_prompts, preemption=preemption, logger=logger, start=start,
               window=s2t.QuantileWindow(cfg.quantile_window, window)
               if cfg.quantile_window else None)


def fitting(cfg: config.Config, tokenizer, rows: tuple[list[dict], list[dict]],
            rank: int) -> tuple[list[dict], list[list[int]], list[dict], list[list[int]]]:
    """(training rows, their prompts, held-out rows, their prompts): the rows whose prompt fits
    --max-prompt-len (D44), with one line on rank 0 of how many did not; a ValueError when
    none of the training rows fits or too few for a step do."""
    train_rows, train_prompts, dropped = rollout.fitting_prompts(tokenizer, rows[0], cfg.chat,
                                                                 cfg.instruction,
                                                                 cfg.max_prompt_len)
    test_rows, test_prompts, dropped_test = rollout.fitting_prompts(tokenizer, rows[1], cfg.chat,
                                                                    cfg.instruction,
                                                                    cfg.max_prompt_len)
    if not train_prompts:
        raise ValueError(f"every prompt of {cfg.data or 'the built-in task'} is longer than "
                         "--max-prompt-len")
    config.too_few(cfg, len(train_prompts))
    if (dropped or dropped_test) and rank == 0:
        print(f"train.py: dropped {dropped} of {dropped + len(train_prompts)} training prompts and "
              f"{dropped_test} of {dropped_test + len(test_prompts)} held-out prompts longer than "
              f"--max-prompt-len {cfg.max_prompt_len} tokens", file=sys.stderr, flush=True)
    return train_rows, train_prompts, test_rows, test_prompts
