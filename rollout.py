"""Rollouts (docs/paper.md §1 and §6): G responses per prompt from the rollout policy pi_old, at
temperature 1.0 / top-p 1.0 in training. Prompt formatting (the instruction is data.INSTRUCTION;
`fitting_prompts` keeps the prompts that fit --max-prompt-len), the reference batched sampler with a
KV cache (`generate`) and the `Rollout` batch.

The sampler is the whole of `generate`: left-pad the prompts, prefill each distinct prompt once (the
G rows of a group take copies of its KV cache), then decode one token per step with a KV cache
allocated once and written in place, computing logits only for the last position. Per step: one
backbone forward and one head matmul, as `model.Policy` computes the training forward (so the
sampling distribution and the recomputed pi_old agree, up to the matmul kernel: D8), two
passes over the vocabulary to sample, and writes into preallocated (B, T) buffers.

Its fast decode step is fast_decode/ (written out layer by layer, or captured in CUDA graphs); the
engines train.py and eval.py call, which return the same `Rollout` (`PlainEngine`: this sampler on
the policy's weights; the vLLM engine), and `make_engine`, which picks one by name, sit above this
file in engines/. Deliberate differences D1-D10: docs/paper.md, "Deliberate differences".
"""
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Callable

import torch

from data import INSTRUCTION
from fast_decode.cuda_graphs import CapturedStep
from fast_decode.decode_step import DecodeStep, InPlaceCache, drop_finished, onednn_linears, packed
from model import attention_buckets, first_with_same_prompt, position_ids_from_mask


def format_prompt(tokenizer, problem: str, chat: bool = True,
                  instruction: str = INSTRUCTION) -> list[int]:
    """Token ids of `problem` followed by the paper's instruction, as one user turn of the chat
    template (with the assistant header appended) or, with chat=False, as raw text (for base
    models)."""
    content = f"{problem}\n{instruction}" if instruction else problem
    if not chat:
        return tokenizer(content).input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def fitting_prompts(tokenizer, rows: list[dict], chat: bool, instruction: str,
                    max_len: int) -> tuple[list[dict], list[list[int]], int]:
    """(the rows {"problem", ...} whose prompt (`format_prompt`) has at most `max_len` tokens, their
    prompts, how many rows were dropped). A token spells at most `longest` characters, so a problem
    longer than max_len x longest characters has more tokens than max_len: it is dropped before it
    is tokenized (a 20 MB row took 11 GB and 74 s to tokenize)."""
    longest = max(map(len, tokenizer.get_vocab()))
    short = [r for r in rows if len(r["problem"]) <= max_len * longest]
    prompts = [format_prompt(tokenizer, r["problem"], chat, instruction) for r in short]
    keep = [i for i, p in enumerate(prompts) if len(p) <= max_len]
    return [short[i] for i in keep], [prompts[i] for i in keep], len(rows) - len(keep)

def eos_ids(lm, tokenizer, chat: bool) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS, the generation config's and, with chat
    prompts, the ChatML end of turn `<|im_end|>` (Qwen3-Base's generation config names only
    <|endoftext|>, while its chat template ends the assistant turn with <|im_end|>)."""
    gen = getattr(lm.generation_config, "eos_token_id", None)
    chatml = chat and "<|im_end|>" in tokenizer.get_vocab()
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if chatml else None
    gen = gen if isinstance(gen, list) else [gen]
    return sorted({tokenizer.eos_token_id, turn_end, *gen} - {None})


@dataclass
class Rollout:
    """One batch of sampled responses. Prompts are left-padded, responses right-padded."""
    prompt_ids: torch.Tensor     # (B, P) long, left-padded
    prompt_mask: torch.Tensor    # (B, P) long 0/1
    response_ids: torch.Tensor   # (B, T) long, pad after EOS
    response_mask: torch.Tensor  # (B, T) long 0/1: 1 on every generated token including EOS
    # (B, T) float32: the sampler's log pi(y_t | x, y_<t) under the full tempered softmax, 0 at
    # pad: what the rollout engine reports (pi_old is recomputed by the training forward, D39)
    sampler_logprobs: torch.Tensor
    truncated: torch.Tensor      # (B,) bool: no EOS within max_new_tokens

    def training_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids (B, P+T), attention_mask (B, P+T)) for a teacher-forced forward over
        prompt + response."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, P+T)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)  # (B, P+T)
        return input_ids, attention_mask

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device) -> "Rollout":
        """The same batch on `device` (an engine's batch -> the trainer's device)."""
        return Rollout(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, idx) -> "Rollout":
        """The rows `idx` (an int list, slice, or index tensor), e.g. one micro-batch."""
        return Rollout(*(getattr(self, f.name)[idx] for f in fields(self)))

    def lengths(self) -> torch.Tensor:
        """(B,) prompt + response tokens of each row: the tokens `model.Policy` packs for it."""
        return self.prompt_mask.sum(1) + self.response_mask.sum(1)

    def micro_batches(self, max_tokens: int, agree=None) -> list[torch.Tensor]:
        """Row indices of micro-batches of at most `max_tokens` tokens, counted as the rows'
        prompt + response tokens (`lengths`, no padding: verl's dynamic batch size); a row longer
        than that is a micro-batch of its own (so max_tokens=1: one row each). `model.Policy` runs
        those tokens packed in one row, a prompt shared by several rows once, and attention lays
        them out in length buckets (`model.attention_buckets`, < 10% padding): the budget bounds
        every activation of the micro-batch.

        Rows are ordered by prompt group (the rows of one prompt together, so a micro-batch that
        holds them runs the prompt once), groups longest row first, and longest first within a group
        (the longest attention layout runs first, so an out-of-memory shows at once), then cut into
        consecutive runs. `agree(count) -> count` turns the fewest micro-batches the budget allows
        into the number to make; train.py passes the maximum over ranks, because every micro-batch
        is an FSDP forward (an all-gather per layer) that all ranks must make together (verl's
        `rearrange_micro_batches(..., same_micro_num_in_dp=True)`). The rows are balanced over that
        many micro-batches: the largest is as small as `count` consecutive runs of the ordered rows
        allow."""
        lengths = self.lengths().tolist()
        first = first_with_same_prompt(self.prompt_ids, self.prompt_mask).tolist()  # (B,) groups
        longest = {}
        for i, g in enumerate(first):
            longest[g] = max(longest.get(g, 0), lengths[i])
        order = sorted(range(len(lengths)),  # stable
                       key=lambda i: (-longest[first[i]], first[i], -lengths[i]))
        srt = [lengths[i] for i in order]
        need = len(_consecutive_runs(srt, max_tokens))
        count = agree(need) if agree else need
        if not need <= count <= len(order):
            raise ValueError(f"cannot cut {len(order)} rows into {count} micro-batches "
                             f"(they need {need})")
        low, high = 1, max_tokens  # binary search: the smallest cap giving at most `count` runs
        while low < high:
            cap = (low + high) // 2
            low, high = (low, cap) if len(_consecutive_runs(srt, cap)) <= count else (cap + 1, high)
        runs = _consecutive_runs(srt, low)
        while len(runs) < count:  # halve the largest run of several rows (rows >= count)
            j = max((j for j, (s, e) in enumerate(runs) if e - s > 1),
                    key=lambda j: sum(srt[runs[j][0]:runs[j][1]]))
            s, e = runs[j]
            runs[j:j + 1] = [(s, (s + e) // 2), ((s + e) // 2, e)]
        return [torch.tensor(order[s:e]) for s, e in runs]

    def packed_sizes(self) -> tuple[int, int]:
        """(tokens `model.Policy` runs through the backbone for these rows as one micro-batch: every
        row's real tokens, a prompt shared by several rows once; cells of its attention layouts,
        padding included, from `model.attention_buckets`)."""
        lengths = self.lengths()  # (B,)
        first = first_with_same_prompt(self.prompt_ids, self.prompt_mask)  # (B,)
        shared = self.prompt_mask.sum(1)[first != torch.arange(len(self),
                                                               device=first.device)].sum()
        n = lengths.tolist()
        return int(lengths.sum() - shared), sum(len(b) * n[b[0]] for b in attention_buckets(n))

    def texts(self, tokenizer) -> list[str]:
        """Decoded responses without special tokens (EOS and padding dropped)."""
        return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                for ids, mask in zip(self.response_ids, self.response_mask)]


def _consecutive_runs(lengths: list[int], cap: int) -> list[tuple[int, int]]:
    """Cut `lengths` into the fewest consecutive runs [s, e) with sum(lengths[s:e]) <= cap (a longer
    row alone): each run takes rows while one more fits (greedy is the fewest)."""
    runs, s = [], 0
    while s < len(lengths):
        e, total = s + 1, lengths[s]
        while e < len(lengths) and total + lengths[e] <= cap:
            total += lengths[e]
            e += 1
        runs.append((s, e))
        s = e
    return runs


def left_pad(prompt_ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (B, P) long: the prompts left-padded to the longest."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad, dtype=torch.long)  # (B, P)
    mask = torch.zeros(len(prompt_ids), P, dtype=torch.long)  # (B, P)
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids, mask


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with probability (cdf[i] - cdf[i-1]) / cdf[-1] per row, from one uniform u in [0, 1).
    (B, V') -> (B,)

    x = (1 - u) * total lies in (0, total], so the first index with cdf >= x always has nonzero
    probability. (torch.multinomial does the same search but costs 3-20x more on CPU.)"""
    return torch.searchsorted(cdf, (1 - u[:, None]) * cdf[:, -1:]).squeeze(1)  # (B,)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits (B, V') and uniforms u (B,) -> (token (B,), its log-prob under
    the full tempered softmax (B,)). Two passes over the vocabulary when top_p = 1 (exp, cumulative
    sum), no sort:
    log pi(v) = z_v - max(z) - log sum_w exp(z_w - max(z)), z = logits / temperature."""
    # (B, V'); greedy: temperature 1 (D3)
    z = logits.float() if temperature in (0, 1) else logits.float() / temperature
    z_max = z.amax(dim=-1, keepdim=True)  # (B, 1)
    weights = (z - z_max).exp_()  # (B, V') unnormalized pi(v) = exp(z_v - max z)
    if temperature == 0:
        token, total = z.argmax(dim=-1), weights.sum(dim=-1)  # (B,), (B,)
    elif top_p < 1.0:  # nucleus: the smallest set of most likely tokens whose mass is >= top_p
        total = weights.sum(dim=-1)  # (B,)
        sorted_w, order = weights.sort(dim=-1, descending=True)  # (B, V')
        cdf = sorted_w.cumsum(dim=-1)  # (B, V')
        keep = cdf - sorted_w < top_p * total[:, None]  # mass before the token < p: the top kept
        token = order.gather(-1, _inverse_cdf((sorted_w * keep).cumsum(dim=-1),
                                              u)[:, None]).squeeze(1)
    else:
        cdf = weights.cumsum(dim=-1)  # (B, V')
        token, total = _inverse_cdf(cdf, u), cdf[:, -1]  # (B,), (B,)
    return token, z.gather(-1, token[:, None]).squeeze(1) - z_max.squeeze(1) - total.log()  # D1


# Finished rows leave the running batch once they are this share of it (D4). A drop copies
# only the caches of the rows moved into the freed slots; tools/bench/engines.py compares cadences.
COMPACT_FRACTION = 0.0


class StopText:
    """--stop-text: a response ends with the token at which one of `texts` first appears in its
    decoded text, as vLLM's `stop` does (matched across token boundaries, in the generated text
    only); that token stays in the response, as EOS does, and the reward reads the whole response.

    The text is decoded as `Rollout.texts` decodes it (special tokens skipped). A text of n UTF-8
    bytes spans at most n tokens that are not special (each spells at least one byte), so a match
    ending at a token lies in the text of the last n + 1 of them without touching the first, whose
    decoding alone may lose a leading space or split a character. Only tokens that can end a match
    are decoded: those whose own text holds the last character of a stop text, or that spell no
    whole character alone (`may_end`, one pass over the vocabulary)."""

    def __init__(self, tokenizer, texts: list[str]):
        if not texts or not all(texts):
            raise ValueError("--stop-text takes non-empty texts")
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.window = max(len(t.encode()) for t in self.texts) + 1  # tokens that are not special
        self.special = set(tokenizer.all_special_ids)
        lasts = {t[-1] for t in self.texts}
        spelled = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))  # in id order
        alone = [tokenizer.convert_tokens_to_string([s]) if s is not None else "" for s in spelled]
        self.may_end = torch.tensor([not a or "\ufffd" in a or any(c in a for c in lasts)  # (V,)
                                     for a in alone])

    def ends(self, response_ids: torch.Tensor, start: int) -> torch.Tensor:
        """(R,) long: for each row of response_ids (R, t) the first column >= start whose token
        completes a stop text, or -1 (none)."""
        where = torch.full((response_ids.shape[0],), -1, dtype=torch.long)  # (R,)
        ids = response_ids.cpu()  # (R, t)
        maybe = self.may_end[ids[:, start:].clamp(0, len(self.may_end) - 1)]  # (R, t - start)
        for r, c in maybe.nonzero().tolist():
            if where[r] >= 0:
                continue  # this row's first match is found
            text = self.tokenizer.decode(self.tail(ids[r, :start + c + 1].tolist()),
                                         skip_special_tokens=True)
            if any(t in text for t in self.texts):
                where[r] = start + c
        return where.to(response_ids.device)

    def tail(self, ids: list[int]) -> list[int]:
        """The shortest end of `ids` that holds `window` tokens that are not special (or all of
        `ids`)."""
        i, n = len(ids), 0
        while i > 0 and n < self.window:
            i -= 1
            n += ids[i] not in self.special
        return ids[i:]


@dataclass(frozen=True)
class Sampling:
    """How `generate` draws a response and where it ends: at most `max_new_tokens` tokens, at
    `temperature` (0: greedy) from the nucleus `top_p` of the first `vocab_size` token ids (the real
    ones; None: all rows), ending with one of `eos_token_id` or with the token that completes one of
    `stop_text`'s texts (`StopText`, checked where EOS is), `pad_token_id` after the end.
    eos_token_id/pad_token_id default to the model config's."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    vocab_size: int | None = None
    stop_text: StopText | None = None


def generate(model, prompt_ids: list[list[int]], sampling: Sampling,
             generator: torch.Generator | None = None, compact: float | None = COMPACT_FRACTION,
             stop: Callable[[], bool] | None = None,
             written_out: "bool | DecodeStep | CapturedStep" = True) -> Rollout:
    """Sample one response per prompt from the HF causal LM `model` (under FSDP2: `policy.lm` inside
    `gathered`), as `sampling` says.

    `generator` (on the model's device) makes the rollout reproducible. Finished rows leave the
    running batch once they are a share `compact` of it (0: as soon as any row finishes; None:
    never; the tokens are the same either way). `stop()`, asked at each stop check, ends the
    call early (the trainer's stop signal, run_folder.Preemption): that rollout is incomplete, the
    caller drops it. `written_out`: decode through `DecodeStep` where it supports the model
    (D9), built for this call; a `DecodeStep` of this model built since its weights last
    changed (`PlainEngine` builds one per rollout phase): through that one; a `CapturedStep` of such
    a step: through its static cache and graphs (D10); False: through the model's own
    forward at every step (the same tokens up to rounding).
    The KV cache goes in as `past_key_values` (transformers 5.17-5.19; later 5.x also call it
    `cache`).
    """
    device = next(model.parameters()).device
    vocab_size, stop_text = sampling.vocab_size, sampling.stop_text
    eos_ids = model.config.eos_token_id if sampling.eos_token_id is None else sampling.eos_token_id
    eos = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), device=device)
    pad = model.config.pad_token_id if sampling.pad_token_id is None else sampling.pad_token_id
    B, T = len(prompt_ids), sampling.max_new_tokens
    prompt, prompt_mask = (x.to(device) for x in left_pad(prompt_ids, pad))  # (B, P)
    P = prompt.shape[1]
    decoder = model.get_decoder()
    captured = written_out if isinstance(written_out, CapturedStep) else None  # D10
    # D9 (a bare call on CUDA: the model's forward)
    step = captured.step if captured else written_out if isinstance(written_out, DecodeStep) else \
        DecodeStep(model, vocab_size) if written_out and DecodeStep.supports(model) and not \
        next(model.parameters()).is_cuda else None
    if step is not None and (step.decoder is not decoder or step.vocab_size != vocab_size):
        raise ValueError(f"generate got the DecodeStep of another model or vocab_size "
                         f"({step.vocab_size}, not {vocab_size})")
    # inference_mode: cheaper per op; oneDNN linears on CPU (D8)
    with torch.inference_mode(), nullcontext() if step else onednn_linears(decoder):
        # Full-batch output buffers, and the running batch: `rows` (R,) are the rows still decoding,
        # in the order of the cache's first R rows, as are their attention mask and positions.
        # Generated positions are always attended, so response token t sits at position
        # len(prompt) + t, as position_ids_from_mask gives. Without left padding the mask is left
        # out (transformers would check every step that it is all ones).
        response_ids = torch.full((B, T), pad, dtype=torch.long, device=device)  # (B, T)
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)  # (B, T)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) EOS or a stop text emitted
        stop_at = torch.full((B,), T, dtype=torch.long, device=device)  # (B,) a stop text's end
        checked = 0  # response columns searched for stop texts so far
        rows = torch.arange(B, device=device)  # (R,)
        padded = not bool(prompt_mask.all())
        attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, T)], dim=1)  # (R, P+T)
        positions = prompt_mask.sum(dim=1, keepdim=True) + torch.arange(T, device=device)  # (R, T)
        # Reading "how many are done" back to the host is free on CPU, a stall on a GPU: check less
        # often there.
        check_every = 1 if device.type == "cpu" else 8

        # The backbone and the LM head are called as Policy.forward calls them, so the sampler and
        # the training forward compute the same distribution (up to the matmul kernel on CPU:
        # D8), and the head only sees the last position.
        # (R, D) -> (R, V')
        head = step.head if step else packed(model.get_output_embeddings().weight[:vocab_size])
        cache = captured.cache(B, P + T) if captured else InPlaceCache(model.config, B, P + T)
        # Prefill each distinct prompt once (the G rows of a group share it), then give every row
        # its prompt's cache.
        first = first_with_same_prompt(prompt, prompt_mask)  # (B,)
        unique = first.unique()  # (U,) rows that bring a prompt
        hidden = decoder(input_ids=prompt[unique],
                         attention_mask=prompt_mask[unique] if padded else None,
                         past_key_values=cache, use_cache=True,
                         position_ids=position_ids_from_mask(prompt_mask[unique])
                         ).last_hidden_state  # (U, P, D)
        if len(unique) < B:
            slot = torch.searchsorted(unique, first)  # (B,) each row's prompt among the U
            cache.copy_rows(rows, slot, B)
            hidden = hidden[slot]  # (B, P, D)
        logits = head(hidden[:, -1])  # (R, V') real vocabulary rows only (D2)
        greedy = sampling.temperature == 0
        for t in range(T):  # D5: a uniform per row of the full batch, every step
            u = None if greedy else torch.rand(B, generator=generator, device=device)[rows]  # (R,)
            token, logprob = _sample(logits, sampling.temperature, sampling.top_p, u)  # (R,), (R,)
            response_ids[rows, t], logprobs[rows, t] = token, logprob
            done[rows] = done[rows] | torch.isin(token, eos)
            # the columns checked .. t; ends (R,): -1 where no stop text yet
            if stop_text is not None and ((t + 1) % check_every == 0 or t + 1 == T):
                ends = stop_text.ends(response_ids[rows, :t + 1], checked)
                hit = (ends >= 0) & (stop_at[rows] == T)  # (R,) a first match
                stop_at[rows[hit]] = ends[hit]
                done[rows] = done[rows] | hit
                checked = t + 1
            if t + 1 == T:
                break
            if (t + 1) % check_every == 0:  # the one host sync: whether to stop (and to drop rows)
                running = ~done[rows]  # (R,)
                n_running = int(running.sum())
                if n_running == 0 or (stop is not None and stop()):
                    break
                if compact is not None and n_running < len(rows) \
                        and len(rows) - n_running >= compact * len(rows):
                    order = drop_finished(running, cache)  # (R',) D4
                    rows, token = rows[order], token[order]
                    attention_mask, positions = attention_mask[order], positions[order]
            if captured:
                logits = captured(token, positions[:, t:t + 1], attention_mask)  # (R, V')
                continue
            mask = attention_mask[:, :P + t + 1] if padded else None  # (R, P+t+1)
            hidden = step(token, positions[:, t:t + 1], mask, cache) if step else decoder(
                input_ids=token[:, None], attention_mask=mask, position_ids=positions[:, t:t + 1],
                past_key_values=cache,
                use_cache=True).last_hidden_state  # (R, 1, D)
            logits = head(hidden[:, -1])  # (R, V')

    # Rows sample on after their EOS until they are dropped (D4); mask and blank that
    # afterwards. A call ended early (every row finished, or `stop`) made t + 1 tokens.
    response_ids, logprobs = response_ids[:, :t + 1], logprobs[:, :t + 1]  # (B, t + 1)
    is_eos = torch.isin(response_ids, eos)  # (B, T)
    # (B, T): 1 up to and including the first EOS, or the stop text's last token
    response_mask = ((is_eos.cumsum(dim=1) - is_eos.long()) == 0).long()
    response_mask *= torch.arange(t + 1, device=device) <= stop_at[:, None]
    T = int(response_mask.sum(dim=1).max())  # drop all-pad columns
    response_mask = response_mask[:, :T]
    response_ids = response_ids[:, :T].masked_fill(response_mask == 0, pad)
    logprobs = logprobs[:, :T] * response_mask
    return Rollout(prompt, prompt_mask, response_ids, response_mask, logprobs, ~done)


def sample_groups(model, prompt_ids: list[list[int]], group_size: int, sampling: Sampling,
                  **kwargs) -> Rollout:
    """G = group_size responses per prompt in one batch; group i is rows i*G .. i*G+G-1."""
    return generate(model, [p for p in prompt_ids for _ in range(group_size)], sampling, **kwargs)
