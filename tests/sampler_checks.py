"""What the sampler tests share (tests/test_rollout.py, tests/test_fast_decode_*.py,
tests/test_engines_*.py, tests/test_model.py, test_stapo.py): a few prompts of the tiny tokenizer,
the log-probs a training forward recomputes, a two-process run, and the tiny model with EOS made to
win where a chosen token would (`eos_biased_model`)."""
import os
import time

import torch
import torch.multiprocessing as mp

from model import position_ids_from_mask, tiny_model, tiny_tokenizer
from rollout import Rollout, format_prompt

# ==================================================================================================
# rollout.py: the KV-cache sampler
# ==================================================================================================
PROBLEMS = ["1+1", "What is 12*13?", "x", "abc def"]


REAL_VOCAB = 104  # len(tiny_tokenizer()); the tiny model has 128 embedding rows


def toy_prompts() -> list[list[int]]:
    tok = tiny_tokenizer()
    return [format_prompt(tok, p) for p in PROBLEMS]


def recomputed_logprobs(lm, rollout: Rollout, temperature: float,
                        vocab_size: int | None) -> torch.Tensor:
    """log pi(y_t) of every response token from one teacher-forced forward over
    prompt + response. (B, T)"""
    input_ids, attention_mask = rollout.training_inputs()  # (B, P+T)
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    P = rollout.prompt_ids.shape[1]
    # logits (B, T, V'): position P+t-1 predicts token t; the log-probs returned (B, T)
    logits = logits[:, P - 1:-1, :vocab_size].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)


def two_processes(worker, tmp: str, hung: str, timeout_s: float = 120) -> None:
    """worker(rank, init_file, tmp) on 2 spawned processes (file:// rendezvous in tmp); both are
    killed and the test fails with `hung` if they have not finished within timeout_s."""
    ctx = mp.start_processes(worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError(hung)


def eos_biased_model(token: int, scale: float = 1.05):
    """The tiny model with EOS's lm_head row set to `scale` x the row of `token`: EOS then wins
    wherever `token` would (with a positive logit), so greedy responses stop at different
    lengths."""
    lm = tiny_model()
    with torch.no_grad():
        lm.lm_head.weight[2] = scale * lm.lm_head.weight[token]
    return lm
