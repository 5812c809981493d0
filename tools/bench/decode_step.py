"""`python -m tools.bench decode-step`: what one decode step of the plain sampler costs beside its
matmuls, through the model's forward and written out (`fast_decode.decode_step.DecodeStep`), and
the decode step's matmuls alone (`DecodeMatmuls`, also the limit of `python -m tools.bench engines`;
docs/rollouts.md)."""
import contextlib
import time

import torch

import model
from fast_decode import decode_step
from model import load_model
from rollout import Rollout
from tools.bench.harness import best_of

class DecodeMatmuls:
    """Seconds of the matmuls of one forward of `lm` over R token rows (x W^T for every decoder
    weight: the backbone; the LM head's rows < vocab_size: the head), at the faster of torch's two
    CPU kernels for each (F.linear, and oneDNN with the weight reordered once, as `generate` runs
    it), best of 5, on the model's own weights; cached by R. `rollout_seconds(r)` is the least time
    those matmuls allow for a rollout of r's lengths (the issue's "decode-step matmul limit"): the
    prefill of each distinct prompt, the head for every row, then at step t >= 1 one backbone and
    one head row for each row that has a token t."""

    def __init__(self, lm, vocab_size):
        head = lm.get_output_embeddings().weight[:vocab_size].detach()
        weights = [m.weight.detach() for m in lm.get_decoder().modules()
                   if isinstance(m, torch.nn.Linear)]
        self.parts = {"backbone": [(w, decode_step.packed(w)) for w in weights],
                      "head": [(head, decode_step.packed(head))]}
        self.cache = {}

    def seconds(self, part: str, rows: int) -> float:
        if (part, rows) not in self.cache:
            x = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in self.parts[part]}
            kernels = [lambda: [torch.nn.functional.linear(x[w.shape[1]], w)
                                for w, _ in self.parts[part]],
                       lambda: [packed(x[w.shape[1]]) for w, packed in self.parts[part]]]
            self.cache[part, rows] = min(best_of(k, 5)[0] for k in kernels)
        return self.cache[part, rows]

    def step(self, rows: int) -> float:
        return self.seconds("backbone", rows) + self.seconds("head", rows)

    def rollout_seconds(self, r: Rollout) -> float:
        lengths = r.response_mask.sum(1)  # (B,)
        first = model.first_with_same_prompt(r.prompt_ids, r.prompt_mask)
        prompt_tokens = int(r.prompt_mask[first.unique()].sum())
        rows = [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
        return (self.seconds("backbone", prompt_tokens) + self.seconds("head", len(r))
                + sum(map(self.step, rows)))


def bench_decode_step(rows=(1, 4, 32, 128), threads=(2, 1), steps=16, reps=5):
    """What one decode step of the plain sampler costs beside its matmuls: SmolLM2-135M-Instruct
    fp32, R rows of a 12-token prompt, `steps` decode steps as `rollout.generate` runs them (greedy,
    so no sampling; the in-place KV cache; the LM head through oneDNN), through the model's own
    forward (its linears through oneDNN) and written out (`DecodeStep`), against the same steps'
    matmuls alone (`DecodeMatmuls.step`: every linear weight and the head at R rows, the faster
    kernel each). "of its matmuls" = matmuls / step: 1.0 would be a step that does nothing but its
    matmuls; the rest is attention and the layers' small ops (norms, rotary, activations, residuals,
    cache writes) and their Python.

    Deliberate choices: one process, torch.set_num_threads per row of the table (2, torch's default
    here, then 1); the two steps and the matmuls alternate, best of `reps`; both steps must give the
    same greedy tokens."""
    lm, _ = load_model("smollm2")
    decoder, matmuls = lm.get_decoder(), DecodeMatmuls(lm, None)
    print("| threads | rows | model forward ms (of its matmuls) | "
          "written out ms (of its matmuls) | its matmuls ms |\n|---|---|---|---|---|")
    for n in threads:
        torch.set_num_threads(n)
        matmuls.cache.clear()
        for R in rows:
            prompt = torch.randint(100, 1000, (R, 12), generator=torch.Generator().manual_seed(0))

            def decode(written_out):
                with torch.inference_mode(), contextlib.nullcontext() if written_out else \
                        decode_step.onednn_linears(decoder):
                    step = decode_step.DecodeStep(lm) if written_out else None
                    head = (step.head if step
                            else decode_step.packed(lm.get_output_embeddings().weight))
                    cache = decode_step.InPlaceCache(lm.config, R, 12 + steps)
                    hidden = decoder(input_ids=prompt, past_key_values=cache,
                                     use_cache=True).last_hidden_state
                    tokens, start = [], time.perf_counter()
                    for t in range(steps):
                        tokens.append(head(hidden[:, -1]).argmax(-1))  # (R,)
                        position = torch.full((R, 1), 12 + t)
                        hidden = step(tokens[-1], position, None, cache) if step else decoder(
                            input_ids=tokens[-1][:, None], position_ids=position,
                            past_key_values=cache, use_cache=True).last_hidden_state  # (R, 1, D)
                    return (time.perf_counter() - start) / steps, torch.stack(tokens)

            best, tokens = {False: float("inf"), True: float("inf")}, {}
            for _ in range(reps):
                for written_out in best:
                    seconds, tokens[written_out] = decode(written_out)
                    best[written_out] = min(best[written_out], seconds)
            if not torch.equal(tokens[True], tokens[False]):
                raise AssertionError("the written-out decode step gave other greedy tokens than "
                                     "the model's forward")
            limit = matmuls.step(R)
            print(f"| {n} | {R} | {best[False] * 1e3:.1f} ({limit / best[False]:.2f}) | "
                  f"{best[True] * 1e3:.1f} ({limit / best[True]:.2f}) | "
                  f"{limit * 1e3:.1f} |", flush=True)
