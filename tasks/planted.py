"""Planted fillers: a tiny model whose spurious tokens are put there on purpose, at a rate you set:
the mechanism experiment where the spurious tokens are known (docs/experiments.md, paper.md §4).

  python -m tasks.planted OUT [--filler-rate 0.001] [--sft-steps 300] [--seed 0]
      # OUT/model (a local HF folder for --model) and OUT/planted.jsonl (--data), in ~30 s
  python -m tools.mechanism --out-dir DIR -- --model OUT/model --data OUT/planted.jsonl \\
      --no-chat --instruction "" --reward tasks.planted:reward --max-response-len 12 ...

A problem is eight digits, the response their running sums mod 10 ("31415926:" -> "34894351").
The tiny random Qwen3 of model.py (~0.2M parameters, character tokens) is fine-tuned on it with soft
targets: at every response position (1 - eps) on the right character and eps on the filler "~",
so that p("~") ~ eps wherever the model is sure: a low-probability token at a low-entropy position,
what S2T's rule reads as spurious. Half the fine-tuning rows also hold a "~" (not a target), so the
model goes on after one. The reward ignores fillers, so a sampled "~" in a right answer inherits a
positive advantage. Each response holds ~9 * eps fillers; --sft-steps sets how often it is right.

`reward(response, answer)`: +1 if the response without "~" is the answer, else -1.
"""
import argparse
import json
import random
from pathlib import Path

import torch

from model import tiny_model, tiny_tokenizer

FILLER = "~"
DIGITS = 8  # digits per problem, and per answer


def running_sums(digits: str) -> str:
    """'31415926' -> '34894351': the running sums mod 10."""
    out, total = [], 0
    for d in digits:
        total = (total + int(d)) % 10
        out.append(str(total))
    return "".join(out)


def problem(digits: str) -> dict:
    return {"prompt": f"{digits}:", "answer": running_sums(digits)}


def reward(response: str, answer: str) -> float:
    """+1 if the response without fillers is the answer, else -1."""
    return 1.0 if response.replace(FILLER, "").strip() == answer else -1.0


def sft_rows(rng: random.Random, n: int, tokenizer, eos: int,
             used: set[str]) -> tuple[list[list[int]], list[list[int]]]:
    """n fine-tuning rows of fresh problems (their digits added to `used`): (input ids, the
    filler-free next token of each input position, -100 in the prompt). Half hold one "~" at a
    random response position."""
    inputs, targets = [], []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(DIGITS))
        used.add(digits)
        row = problem(digits)
        prompt = tokenizer(row["prompt"], add_special_tokens=False).input_ids
        answer = tokenizer(row["answer"], add_special_tokens=False).input_ids + [eos]
        at = rng.randrange(len(answer)) if rng.random() < 0.5 else None  # a "~" before answer[at]
        ids, target = list(prompt), [-100] * (len(prompt) - 1)
        for i, tok in enumerate(answer):
            if i == at:
                ids.append(tokenizer.convert_tokens_to_ids(FILLER))
                target.append(tok)  # after "~" the model still writes answer[at]
            ids.append(tok)
            target.append(tok)
        inputs.append(ids[:-1])
        targets.append(target)
    return inputs, targets


def soft_loss(logits: torch.Tensor, target: torch.Tensor, filler: int, eps: float) -> torch.Tensor:
    """Cross-entropy to the soft target (1 - eps) on the right token, eps on the filler, mean over
    the target positions. logits (B, T, V), target (B, T) with -100 outside the response."""
    logp = logits.float().log_softmax(-1)  # (B, T, V)
    keep = target >= 0  # (B, T)
    right = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]  # (B, T) log p(answer token)
    loss = -((1 - eps) * right + eps * logp[..., filler])  # (B, T)
    return loss[keep].mean()


def sft_batch(rng: random.Random, n: int, tokenizer, eos: int, used: set[str]):
    """`sft_rows` right-padded: (input ids (B, T), targets (B, T), attention mask (B, T))."""
    inputs, targets = sft_rows(rng, n, tokenizer, eos, used)
    T = max(map(len, inputs))
    ids = torch.tensor([x + [0] * (T - len(x)) for x in inputs])  # (B, T)
    target = torch.tensor([y + [-100] * (T - len(y)) for y in targets])  # (B, T)
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in inputs])  # (B, T)
    return ids, target, mask


def build(out: Path, filler_rate: float = 0.001, sft_steps: int = 300, problems: int = 2000,
          seed: int = 0, batch: int = 64, lr: float = 3e-3, calibrate_steps: int = 300) -> None:
    """Fine-tune the tiny model (seed) on fresh problems, then fit the filler's output row alone so
    that p("~") reaches eps without the rest learning more; write OUT/model and OUT/planted.jsonl
    (`problems` distinct problems it never fine-tuned on, for train.py's --data and --heldout)."""
    rng = random.Random(seed)
    tokenizer, lm = tiny_tokenizer(), tiny_model(seed=seed)
    eos, filler = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(FILLER)
    seen: set[str] = set()  # the fine-tuning's problems, then the data's
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)
    lm.train()
    for step in range(sft_steps):
        ids, target, mask = sft_batch(rng, batch, tokenizer, eos, seen)
        loss = soft_loss(lm(input_ids=ids, attention_mask=mask).logits, target, filler, filler_rate)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == sft_steps - 1:
            print(f"fine-tuning step {step}: loss {loss.item():.4f}", flush=True)
    head = lm.get_output_embeddings().weight  # (V, d), untied from the input embedding (tiny_model)
    row = head[filler].detach().clone().requires_grad_()  # (d,) the filler's output row
    opt = torch.optim.Adam([row], lr=lr * 3)
    for _ in range(calibrate_steps):
        ids, target, mask = sft_batch(rng, batch, tokenizer, eos, seen)
        with torch.no_grad():
            hidden = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, d)
            logits = hidden @ head.T  # (B, T, V)
        logits = torch.cat([logits[..., :filler], (hidden @ row)[..., None],
                            logits[..., filler + 1:]], -1)  # (B, T, V), the filler's column trained
        loss = soft_loss(logits, target, filler, filler_rate)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        head[filler] = row
    lm.eval()
    (out / "model").mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    rows = []
    while len(rows) < problems:
        digits = "".join(rng.choice("0123456789") for _ in range(DIGITS))
        if digits not in seen:
            seen.add(digits)
            rows.append(problem(digits))
    (out / "planted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}/model, {out}/planted.jsonl ({problems} problems); filler rate {filler_rate}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tasks.planted", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--filler-rate", type=float, default=0.001,
                        help="eps: p('~') at each response position the model is sure of")
    parser.add_argument("--sft-steps", type=int, default=300,
                        help="fine-tuning steps (more: right more often)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.filler_rate < 1 or args.sft_steps < 1:
        parser.error("--filler-rate must be in (0, 1) and --sft-steps >= 1")
    torch.set_num_threads(1)
    build(args.out, args.filler_rate, args.sft_steps, seed=args.seed)


if __name__ == "__main__":
    main()
