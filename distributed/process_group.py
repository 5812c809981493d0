"""The process group (torchrun's env:// contract, or one process without it) and the few collectives
training needs: sums and maxima of Python numbers, tensors and records gathered from every rank."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(timeout_min: float = 60.0,
                     always: bool = True) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun (RANK set): the env:// process group (NCCL for
    CUDA tensors, gloo for CPU ones), whose collectives wait `timeout_min` minutes for the slowest
    rank, and this rank's GPU. As a plain process: a 1-process group when `always` (train.py: no
    single-process branches), else none (eval.py)."""
    import datetime

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "RANK" in os.environ:
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_min))
    elif always:
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return (dist.get_rank(), dist.get_world_size(), device) if dist.is_initialized() else \
        (0, 1, device)


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
    """Concatenate 1-D tensors of different lengths from all ranks (pad to the longest, all-gather,
    trim)."""
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
