"""The plain engine (--rollout plain, the default; docs/rollouts.md): rollout.py's reference sampler
`generate` on the policy's own weights, behind the same `sample` call and `Rollout` as the vLLM
engine (docs/paper.md §1 and "Deliberate differences": D6, D9 and D10): a rollout phase keeps
FSDP2's parameters gathered and builds the written-out decode step once (`ready`), and `sample`
makes G responses per prompt in chunks of prompts, one generate call each, joined into one batch
(`concat`).
"""
from contextlib import contextmanager
from typing import Callable

import torch

from attention.packed_sdpa import PACKED_SDPA
from distributed.sharding import gathered
from fast_decode.cuda_graphs import CapturedStep
from fast_decode.decode_step import DecodeStep
from rollout import Rollout, Sampling, StopText, sample_groups


def concat(parts: list[Rollout], pad: int) -> Rollout:
    """One Rollout from several: prompts left-padded to the longest P, responses right-padded to the
    longest T."""
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.response_ids.shape[1] for r in parts)

    def left(x, value):
        return torch.nn.functional.pad(x, (P - x.shape[1], 0), value=value)

    def right(x, value):
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

    return Rollout(
        torch.cat([left(r.prompt_ids, pad) for r in parts]),
        torch.cat([left(r.prompt_mask, 0) for r in parts]),
        torch.cat([right(r.response_ids, pad) for r in parts]),
        torch.cat([right(r.response_mask, 0) for r in parts]),
        torch.cat([right(r.sampler_logprobs, 0.0) for r in parts]),
        torch.cat([r.truncated for r in parts]))


class PlainEngine:
    """`generate` (rollout.py's sampler) on the policy's own weights: the default, and the readable
    reference."""
    name = "plain"

    def __init__(self, lm, eos_token_id, pad_token_id: int, vocab_size: int | None,
                 stop: Callable[[], bool] | None = None, max_len: int | None = None,
                 captured: bool = False, stop_text: StopText | None = None):
        """max_len: the run's longest prompt + response (train.py and eval.py give it), the length
        of a phase's static cache; captured: decode through a `CapturedStep` (D10;
        train.py's --cuda-graphs);
        stop_text: where responses also end (--stop-text)."""
        self.lm, self.eos, self.pad, self.vocab_size = lm, eos_token_id, pad_token_id, vocab_size
        self.stop = stop
        self.stop_text = stop_text
        self.step = True  # generate's `written_out`: a DecodeStep during a rollout phase
        self.max_len = max_len
        self.captured = captured
        self.static = None  # the phase's CapturedStep, made at its first sample call
        lm.set_attn_implementation(PACKED_SDPA)  # as Policy does: grouped_sdpa under a mask

    @contextmanager
    def ready(self, policy):
        """The rollout phase: under FSDP2 the parameters stay gathered (`gathered`); every rank must
        enter. On CPU the decode step's weights are stacked and reordered here, once for every
        generate call of the phase; with `captured`, its static cache and graphs are made at the
        phase's first sample call."""
        with gathered(policy):
            # CUDA: the written-out step only to be captured (D10)
            cuda = next(self.lm.parameters()).is_cuda
            self.step = DecodeStep(self.lm, self.vocab_size) if DecodeStep.supports(self.lm) and (
                self.captured or not cuda) else True
            try:
                yield self
            finally:
                # the copies go; the weights change before the next phase
                self.step, self.static = True, None

    def sample(self, prompts: list[list[int]], group_size: int, seeds: list[int], chunk: int,
               max_new_tokens: int, temperature: float, top_p: float) -> Rollout:
        """`group_size` responses per prompt, `chunk` prompts per generate call, call c seeded with
        seeds[c]; cut short (incomplete) when `stop()` turns true. With `captured` in a phase, the
        phase's static cache holds the largest call's rows x the longest prompt + response, and is
        made anew only if a later call needs more."""
        device, parts, step = next(self.lm.parameters()).device, [], self.step
        if self.captured and isinstance(step, DecodeStep):  # D10
            rows = min(chunk, len(prompts)) * group_size
            length = max(self.max_len or 0, max(map(len, prompts)) + max_new_tokens)
            if self.static is None or self.static.rows < rows or self.static.max_len < length:
                self.static = None  # the smaller cache goes before the larger one is allocated
                self.static = CapturedStep(step, rows, length)
            step = self.static
        sampling = Sampling(max_new_tokens, temperature, top_p, self.eos, self.pad, self.vocab_size,
                            self.stop_text)
        for c, seed in zip(range(0, len(prompts), chunk), seeds):
            parts.append(sample_groups(self.lm, prompts[c:c + chunk], group_size, sampling,
                                       generator=torch.Generator(device).manual_seed(seed),
                                       stop=self.stop, written_out=step))
            if self.stop is not None and self.stop():
                break
        return concat(parts, self.pad)

    def close(self):
        pass
