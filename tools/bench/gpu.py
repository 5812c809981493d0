"""`python -m tools.bench gpu [--smoke] [--out DIR] [--parts ...]`: the CUDA path of training and
rollouts at Qwen3-1.7B shape on one GPU, in one prepared run (docs/gpu.md); `--smoke` runs the same
code at toy shapes on the CPU (the test suite). The Qwen3 shapes, the check's sizes, its tokenizer,
its table and the run; its parts are in tools/bench/gpu_parts.py."""
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

import model
from config import Config
from distributed.process_group import init_distributed
from tools.bench.gpu_parts import (BOX_WORDS, device_limits, gpu_e2e, gpu_numerics, gpu_rollouts,
                                   gpu_train)
from tools.bench.harness import train_run

# The Qwen3 base models' shapes, as in their Hub config.json files. Qwen3-1.7B's: the keras-hub
# conversion's model card (huggingface.co/keras/qwen3_1.7b_en: vocabulary 151936, 28 layers, 16
# query / 8 KV heads, hidden 2048, head_dim 128, intermediate 6144, rope wavelength 1e6, norm eps
# 1e-6, tied embeddings) and slime's scripts/models/qwen3-1.7B.sh (the same numbers);
# max_position_embeddings 40960 as in the Qwen3 dense models' configs.
QWEN3 = {  # the paper's Qwen3 base models, from config.json (vocabulary 151,936; used by `update`)
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False),
    "Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=False),
}
QWEN3_1_7B = dict(QWEN3["Qwen3-1.7B"], vocab_size=151_936, max_position_embeddings=40_960,
                  rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


@dataclass(frozen=True)
class GpuSizes:
    shape: dict  # Qwen3Config fields
    prompt_len: int  # words (= tokens) of each synthetic prompt
    # (response length T, prompts, G, --max-tokens-per-micro-batch) of each one-mini-batch update
    train: tuple
    numerics: tuple  # (sequences, response length) of the bf16-vs-fp32 forward
    head_tokens: int  # N of the chunked-vs-naive LM-head comparison
    # batch sizes of the captured sampler (the first also `model.generate`, the largest eager)
    decode_batches: tuple
    decode_tokens: int  # new tokens per sampled row (EOS never sampled: fixed work)
    e2e: dict  # train.py flags of the end-to-end run


GPU_FULL = GpuSizes(QWEN3_1_7B, 120,
                    ((1024, 4, 8, 32768), (4096, 1, 8, 32768), (16384, 1, 2, 32768)), (4, 1024),
                    4096, (64, 256), 512, dict(steps=2, prompts_per_step=4, group_size=8,
                                               mini_batch_prompts=2, max_response_len=512))
GPU_SMOKE = GpuSizes(dict(QWEN3_1_7B, vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16), 8,
                     ((16, 2, 2, 48), (32, 1, 2, 48), (64, 1, 2, 48)), (2, 16), 64, (2, 4), 8,
                     dict(steps=2, prompts_per_step=2, group_size=2, mini_batch_prompts=1,
                          max_tokens_per_micro_batch=48, max_response_len=8))


def _wide_tokenizer(vocab_size):
    """A word-level ChatML tokenizer built in code with `vocab_size` entries (so the LM head costs
    what Qwen3's does): the specials (ids 0-3), the two box words, then "w0", "w1", ...; text splits
    on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *BOX_WORDS]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab_size - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", unk_token="<unk>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = model.CHATML_TEMPLATE
    return tokenizer


def _gpu_table(rows, header):
    lines = [header, ""]
    parts = {
        "train": ("| one mini-batch update | sequences x T | tokens per micro-batch | tokens | "
                  "update s | tokens/s | MFU | peak GiB | memory model GiB |\n"
                  "|---|---|---|---|---|---|---|---|---|",
                  lambda r: f"| T = {r['T']} | {r['sequences']} x {r['T']} | {r['micro_batch']} | "
                            f"{r['tokens']} | {r['update_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                            f"{r['mfu']:.1%} | {r['peak_gb']:.1f} | {r['estimate_gb']:.1f} |"),
        "numerics": ("| numerics | tokens | max abs diff | mean abs diff | fp32 mean |\n"
                     "|---|---|---|---|---|",
                     lambda r: f"| {r['what']} | {r['tokens']} | {r['max_abs_diff']:.2e} | "
                               f"{r['mean_abs_diff']:.2e} | {r['fp32_mean']:.3f} |"),
        "head": ("| LM head (N x V) | dtype | fwd+bwd s | peak extra GiB | log-prob max diff | "
                 "entropy max diff |\n|---|---|---|---|---|---|",
                 lambda r: f"| {r['impl']}, N = {r['N']} | {r['dtype']} | {r['seconds']:.3f} | "
                           f"{r['peak_extra_gb']:.2f} | {r['logprob_max_abs_diff']:.2e} | "
                           f"{r['entropy_max_abs_diff']:.2e} |"),
        "rollout": ("| sampler (EOS never sampled) | rows x new tokens | tokens/s | per step | "
                    "roofline | of roofline | x eager | first call s (captures) | peak GiB |\n"
                    "|---|---|---|---|---|---|---|---|---|",
                    lambda r: f"| {r['sampler']} | {r['batch']} x {r['new_tokens']} | "
                              f"{r['tokens_per_s']:,.0f} | {r['step_ms']:.2f} ms | "
                              f"{r['roofline_ms']:.2f} ms | "
                              f"{r['roofline_ms'] / r['step_ms']:.0%} | "
                              + (f"{r['speedup']:.1f}x" if r["speedup"] else "") + " | "
                              + (f"{r['first_call_s']:.1f} ({r['graphs']} graphs)"
                                 if r["first_call_s"] else "")
                              + f" | {r['peak_gb']:.1f} |"),
        "captured_check": ("| CapturedStep replayed vs its body run eagerly (same seeds) | "
                           "rows x new tokens | same tokens | log-prob max abs diff |\n"
                           "|---|---|---|---|",
                           lambda r: f"| graphs vs eager | {r['batch']} x {r['new_tokens']} | "
                                     f"{r['same_tokens']} | {r['logprob_max_abs_diff']:.2e} |"),
        "e2e": ("| train.py step | reward/mean | response/len_mean | loss/policy | grad_norm | "
                "updates | rollout s | update s | tokens/s |\n"
                "|---|---|---|---|---|---|---|---|---|",
                lambda r: f"| {r['step']} | {r['reward/mean']:.3f} | "
                          f"{r['response/len_mean']:.0f} | {r['loss/policy']:.4f} | "
                          f"{r['grad_norm']:.3f} | {r['updates']} | {r['time/rollout_s']:.1f} | "
                          f"{r['time/update_s']:.1f} | {r['tokens_per_s']:,.0f} |"),
    }
    for part, (head, fmt) in parts.items():
        lines += [head] + [fmt(r) for r in rows if r["part"] == part] + [""]
    return "\n".join(lines)


# `--parts` chooses among them (default: all, in this order)
GPU_PARTS = ("train", "numerics", "rollout", "e2e")


def bench_gpu(smoke=False, out=None, parts=GPU_PARTS):
    """Paper: STAPO (arXiv:2602.15620), docs/paper.md §6, trains Qwen3-1.7B/8B with FSDP, responses
    up to 15,360 tokens. One prepared run on one CUDA GPU, no network: a random model of
    Qwen3-1.7B's exact shape (QWEN3_1_7B) and a word-level tokenizer of its full vocabulary, saved
    to a temporary folder and loaded by startup.run.setup (FSDP2 via sharding.shard_policy, bf16
    compute / fp32 master weights, activation checkpointing, AdamW); then (1) `train`: one
    train.train_step per response length 1k / 4k / 16k on synthetic rollouts: tokens/s, MFU against
    the bf16 matmul rate measured here, peak memory; (2) `numerics`: log-probs and entropy of that
    policy against an fp32 copy of the same weights, and the chunked LM head against the naive one
    (fp32 and bf16, fp64 reference); (3) `rollout`: rollout.generate inside sharding.gathered x 512
    new tokens through the model's forward and the written-out step eagerly at batch 256, through
    the captured step (cuda_graphs.CapturedStep: CUDA graphs) at batch 64 and 256, and transformers'
    `model.generate` at batch 64, per step against the roofline ((bf16 weight bytes + the KV-cache
    bytes a step reads) / copy bandwidth measured here), and the captured step's graphs against its
    body run eagerly (the same tokens for the same seeds); (4) `e2e`: train.main for 2 steps of a
    scaled-down paper preset (4 prompts x G = 8, 512-token responses). `parts`
    (`--parts train,rollout`) runs some of them. Prints each number as it is measured and one
    markdown table at the end, and writes the table with the raw numbers to OUT/gpu.md and
    OUT/gpu.json (`--out`, default out/bench-gpu) after every part, so a run cut short keeps what it
    measured.

    Deliberate choices:
    1. The rollout engine is replaced by a synthetic one in (1) (uniform random tokens, the last one
       \boxed{1} or \boxed{2}, graded for real), so the update measures exactly train_step's pi_old
       pass, S2T, loss, backward, clip and optimizer step at a fixed length; (3) measures the
       sampler itself.
    2. In (4) rewards are the parity of the response length: a random model is never right, and
       all-wrong groups would skip every update.
    3. MFU counts model FLOPs (3 x forward: 2 x parameters per token, the head on response tokens,
       causal attention), not the recomputation of activation checkpointing or of the chunked head's
       backward.
    4. Only torch + transformers APIs present in torch 2.11-2.13 and transformers 5.17-5.19; vLLM is
       not measured.

    The CUDA path at Qwen3-1.7B shape in one run (<= ~8 minutes on an H200): FSDP2 training steps,
    numerics, the sampler, and train.py end to end. `smoke`: the same code at toy shapes on the CPU
    (fp32, no mixed precision), in seconds; the test suite runs it.
    """
    import importlib.util

    unknown = set(parts) - set(GPU_PARTS)
    if unknown:
        sys.exit(f"tools.bench gpu: unknown part(s) {sorted(unknown)}; choose from "
                 f"{', '.join(GPU_PARTS)}")
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        sys.exit("tools.bench gpu: no CUDA GPU here; `python -m tools.bench gpu --smoke` runs the "
                 "same code on the CPU")
    sizes, device = (GPU_FULL, torch.device("cuda")) if cuda else (GPU_SMOKE, torch.device("cpu"))
    out_dir = Path(out or ("out/bench-gpu" if cuda else "out/bench-gpu-smoke"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    # the random model and tokenizer, saved like a checkpoint (train.py and eval.py load it by path)
    torch.manual_seed(0)
    config = Qwen3Config(**sizes.shape, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        lm = Qwen3ForCausalLM(config)
    tokenizer = _wide_tokenizer(config.vocab_size)
    model_dir = str(work / "model")
    lm.to(torch.bfloat16).save_pretrained(model_dir)  # bf16 on disk (half the bytes); loads as fp32
    tokenizer.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in lm.parameters())
    del lm
    data = work / "data.jsonl"  # distinct prompts of prompt_len words, gold "1"
    data.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7919 + j) % 1000}"
                                                           for j in range(sizes.prompt_len)),
                                        "answer": "1"}) + "\n" for i in range(16)))
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth, flops_rate = device_limits(device, dtype)
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    header = (f"python -m tools.bench gpu{' --smoke' if smoke else ''}: {device_name}, torch "
              f"{torch.__version__}, transformers {__import__('transformers').__version__}, Python "
              f"{sys.version.split()[0]}; random Qwen3 model of {n_params:,} parameters "
              f"(vocabulary {config.vocab_size}); measured copy bandwidth {bandwidth / 1e9:.0f} "
              f"GB/s, {str(dtype).removeprefix('torch.')} matmul {flops_rate / 1e12:.3g} TFLOP/s")
    print(header, flush=True)
    rows = []
    skip = "vLLM: not measured (" + ("not installed here"
                                     if importlib.util.find_spec("vllm") is None
                                     else "installed; this check measures the plain sampler") + ")"

    def write():  # the table so far, after every part
        table = _gpu_table(rows, header) + f"{skip}\n\nparts: {', '.join(parts)}; whole run: " \
            f"{time.perf_counter() - start:.0f} s\n"
        (out_dir / "gpu.md").write_text(table)
        (out_dir / "gpu.json").write_text(json.dumps({"header": header, "rows": rows,
                                                      "parts": list(parts),
                                                      "total_s": time.perf_counter() - start,
                                                      "vllm": skip}, indent=1))
        return table

    cfg = Config(preset="paper", model=model_dir, data=str(data), prompt_key="prompt",
                 answer_key="answer", instruction="", chat=False, grad_checkpointing=True,
                 fsdp=True, warmup_steps=0, save_every=0, rollout="plain",
                 out_dir=str(work / "train"), prompts_per_step=1, mini_batch_prompts=1)
    if {"train", "numerics", "rollout"} & set(parts):
        init_distributed()
        try:
            # load_model(dir), Policy, gradient checkpointing, FSDP2, AdamW
            state = train_run(cfg, device)
            for part, fn, args in (
                    ("train", gpu_train, (sizes, cfg, state, device, flops_rate, rows)),
                    ("numerics", gpu_numerics, (sizes, cfg, state, device, rows)),
                    ("rollout", gpu_rollouts, (sizes, state, device, bandwidth, rows))):
                if part in parts:
                    fn(*args)
                    write()
            del state
        finally:
            dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "e2e" in parts:
        gpu_e2e(sizes, model_dir, str(data), device, work, rows)
    print("\n" + write(), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return rows
