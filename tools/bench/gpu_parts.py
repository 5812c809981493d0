"""The parts of `python -m tools.bench gpu` (tools/bench/gpu.py; docs/gpu.md), each appending its
rows to the check's list: `train` (train.train_step on synthetic rollouts under FSDP2), `numerics`
(the policy's bf16 forward and the chunked LM head against fp32 / fp64 references), `rollout`
(rollout.generate eager, written out and captured in CUDA graphs, and model.generate, against the
roofline) and `e2e` (train.main for a few steps); the device's timers and limits, the synthetic
rollout engine."""
import json
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import replace

import torch
from transformers import Qwen3ForCausalLM

import reward
import rollout
import train
from distributed.sharding import gathered
from fast_decode import cuda_graphs, decode_step
from memory.estimate import RolloutCall, kv_cache_bytes, memory_estimate
from model import Policy
from rollout import Sampling, generate
from tools.bench.logprobs import chunked_logprobs, naive_logprobs

# the last token of a synthetic response: graded right / wrong for gold 1
BOX_WORDS = ["\\boxed{1}", "\\boxed{2}"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dev_timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _peak_gb(device):
    return (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
            else float("nan"))


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_limits(device, dtype):
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s in `dtype`), medians of 5, on
    `device`."""
    n = 2**30 if device.type == "cuda" else 2**24  # 2 GiB of bf16 / 64 MiB of fp32
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy = statistics.median(_dev_timed(lambda: dst.copy_(src), device)[0] for _ in range(5))
    m = 16384 if device.type == "cuda" else 512
    a, b = (torch.randn(m, m, device=device, dtype=dtype),
            torch.randn(m, m, device=device, dtype=dtype))
    a @ b  # warm-up (cuBLAS handles, kernel choice)
    mm = statistics.median(_dev_timed(lambda: a @ b, device)[0] for _ in range(5))
    return 2 * n * src.element_size() / copy, 2 * m**3 / mm


class _SyntheticEngine:
    """Stands in for the rollout engine: T tokens per response drawn uniformly from the word ids,
    the last one \\boxed{1} (even rows, right for gold 1) or \\boxed{2} (odd rows): mixed groups, so
    the update has nonzero advantages."""
    def __init__(self, T, device, tokenizer):
        self.T, self.device, self.tokenizer = T, device, tokenizer

    @contextmanager
    def ready(self, policy):
        yield self

    def sample(self, prompts, group_size, seeds, chunk=None, max_new_tokens=None, temperature=None,
               top_p=None):
        T, device, tokenizer = self.T, self.device, self.tokenizer
        rows = [p for p in prompts for _ in range(group_size)]
        B, P, pad = len(rows), max(len(p) for p in rows), tokenizer.pad_token_id
        # (B, P) each, left-padded
        prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in rows], device=device)
        prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows], device=device)
        g = torch.Generator(device).manual_seed(seeds[0])
        first_word = len(BOX_WORDS) + 4
        response = torch.randint(first_word, len(tokenizer), (B, T), generator=g,
                                 device=device)  # (B, T)
        box = tokenizer.convert_tokens_to_ids(BOX_WORDS)
        response[:, -1] = torch.tensor([box[i % 2] for i in range(B)], device=device)
        # (B, T) no EOS: every token is a response token
        ones = torch.ones(B, T, dtype=torch.long, device=device)
        logprobs = torch.full((B, T), -math.log(len(tokenizer)), device=device)  # (B, T)
        return rollout.Rollout(prompt_ids, prompt_mask, response, ones, logprobs,
                               torch.ones(B, dtype=torch.bool, device=device))


def _train_flops(lm, prompt_len, T, n_seq):
    """Model FLOPs of one forward + backward (3 x forward; activation recomputation not counted):
    2 x body parameters per token, the LM head on response tokens only, causal attention
    2 x 2 x L^2 / 2 x heads x head_dim per layer."""
    c = lm.config
    body = sum(p.numel() for p in lm.get_decoder().layers.parameters())
    L = prompt_len + T
    forward = 2 * body * L + 2 * c.vocab_size * c.hidden_size * T + \
        2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * L * L
    return 3 * forward * n_seq


def gpu_train(sizes, cfg, state, device, flops_rate, out):
    """One train.train_step per response length on synthetic rollouts: the real pi_old pass, S2T,
    loss, backward, clip and AdamW step under FSDP2 (bf16 compute, fp32 master weights, activation
    checkpointing)."""
    policy, tokenizer = state.policy, state.tokenizer
    lm = policy.lm
    # the first (sizes.train[0] twice): warm-up
    for k, (T, n_prompts, G, micro) in enumerate(((sizes.train[0],) + sizes.train)):
        step_cfg = replace(cfg, max_response_len=T, prompts_per_step=n_prompts,
                           mini_batch_prompts=n_prompts, group_size=G,
                           max_tokens_per_micro_batch=micro)
        _reset_peak(device)
        engine = _SyntheticEngine(T, device, tokenizer)
        seconds, (metrics, *_) = _dev_timed(
            lambda: train.logged_step(replace(state, cfg=step_cfg, engine=engine), k), device)
        if k == 0:
            continue
        n_seq, row = n_prompts * G, sizes.prompt_len + T
        tokens = n_seq * row
        update = metrics["time/update_s"]
        estimate = memory_estimate(  # the arguments startup.run.setup prints its memory line with
            lm.config, 1, min(max(micro, row), n_seq * row), True,
            RolloutCall(n_seq, sizes.prompt_len, T), fsdp=True,
            compute_bytes=2 if device.type == "cuda" else 4,
            chunk_size=cfg.chunk_size)["train_peak"]
        out.append({"part": "train", "T": T, "sequences": n_seq, "micro_batch": micro,
                    "tokens": tokens, "updates": metrics["updates"], "update_s": update,
                    "step_s": seconds, "pi_old_and_grading_s": metrics["time/rollout_s"],
                    "tokens_per_s": tokens / update,
                    "mfu": _train_flops(lm, sizes.prompt_len, T, n_seq) / update / flops_rate,
                    "peak_gb": _peak_gb(device), "estimate_gb": estimate,
                    "loss": metrics["loss/policy"], "grad_norm": metrics["grad_norm"]})
        print(f"train T={T}: {out[-1]['tokens_per_s']:,.0f} tokens/s, MFU {out[-1]['mfu']:.1%}, "
              f"peak {out[-1]['peak_gb']:.1f} GiB (memory model: {estimate:.1f} GiB)", flush=True)


def gpu_numerics(sizes, cfg, state, device, out):
    """Log-probs and entropy of the sharded policy (bf16 compute on CUDA) against an fp32 copy of
    the same weights, and the chunked LM head against the naive full-logits computation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    policy, tokenizer = state.policy, state.tokenizer
    # the fp32 master weights
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
    with torch.device(device):
        ref_lm = Qwen3ForCausalLM(policy.lm.config).float()
    missing, unexpected = ref_lm.load_state_dict({k.removeprefix("lm."): v.float()
                                                  for k, v in full.items()},
                                                 strict=False)
    # lm_head.weight missing: tied, one tensor
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref = Policy(ref_lm.eval(), vocab_size=policy.vocab_size)
    n_seq, T = sizes.numerics
    prompts = state.prompts[:1] * (n_seq // 2)
    batch = _SyntheticEngine(T, device, tokenizer).sample(prompts, 2, [0])
    policy.eval()
    got, want = (train.token_stats(policy, batch, cfg, device),
                 train.token_stats(ref, batch, cfg, device))
    mask = batch.response_mask.bool()
    for name, a, b in (("logprobs", got[0], want[0]), ("entropy", got[1], want[1])):
        diff = (a - b)[mask].abs()
        out.append({"part": "numerics", "what": f"{name}: policy forward vs fp32 forward",
                    "tokens": int(mask.sum()), "max_abs_diff": diff.max().item(),
                    "mean_abs_diff": diff.mean().item(), "fp32_mean": b[mask].mean().item()})
        print(f"numerics {name}: max abs diff {out[-1]['max_abs_diff']:.2e}, mean "
              f"{out[-1]['mean_abs_diff']:.2e} (fp32 mean {out[-1]['fp32_mean']:.3f})", flush=True)
    del ref, ref_lm, full
    # the LM head alone: chunked vs naive (N, V) logits, forward + backward, fp32 reference
    N, V_, D_ = sizes.head_tokens, policy.lm.config.vocab_size, policy.lm.config.hidden_size
    g = torch.Generator(device).manual_seed(0)
    h32 = torch.randn(N, D_, device=device, generator=g)  # (N, D)
    w32 = torch.randn(V_, D_, device=device, generator=g) * 0.02  # (V, D)
    y = torch.randint(V_, (N,), device=device, generator=g)  # (N,)
    ref_lp, ref_h = naive_logprobs(h32.double(), w32.double(), y)
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for name, impl in (("naive", naive_logprobs), ("chunked", chunked_logprobs)):
            hidden = h32.to(dtype, copy=True).requires_grad_()  # (N, D) a fresh leaf
            weight = w32.to(dtype, copy=True).requires_grad_()  # (V, D)
            impl(hidden, weight, y)  # warm-up
            hidden.grad = weight.grad = None
            _reset_peak(device)
            base = (torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda"
                    else float("nan"))

            def fwd_bwd():
                lp, ent = impl(hidden, weight, y)
                lp.float().sum().backward()
                return lp, ent
            seconds, (lp, ent) = _dev_timed(fwd_bwd, device)
            out.append({"part": "head", "impl": name, "dtype": str(dtype).removeprefix("torch."),
                        "N": N, "seconds": seconds, "peak_extra_gb": _peak_gb(device) - base,
                        "logprob_max_abs_diff": (lp.double() - ref_lp).abs().max().item(),
                        "entropy_max_abs_diff": (ent.double() - ref_h).abs().max().item()})
            print(f"LM head {name} {out[-1]['dtype']}: {seconds:.3f} s, log-prob max diff "
                  f"{out[-1]['logprob_max_abs_diff']:.2e}", flush=True)
            del lp, ent


def gpu_rollouts(sizes, state, device, bandwidth, out):
    """rollout.generate inside sharding.gathered (the training path), EOS never sampled (fixed
    work), three ways: through the model's forward (`written_out=False`: the eager sampler of
    docs/gpu.md's first runs) and through the written-out step eagerly (`DecodeStep`) at the largest
    batch, and through the captured step (`CapturedStep`, one static cache for every batch size, as
    in a rollout phase; its graphs are captured in a first call of the same size, timed apart) at
    every batch size; and transformers' `model.generate` at the first (sampling at T = 1, no
    top-k / top-p, EOS masked). A step against the roofline: (weight bytes + the KV-cache bytes a
    step reads, its filled length averaged over the call's steps) / the measured copy bandwidth."""
    policy, tokenizer = state.policy, state.tokenizer
    prompt = state.prompts[0]
    V_, P, n_new, largest = (len(tokenizer), len(state.prompts[0]), sizes.decode_tokens,
                             max(sizes.decode_batches))
    policy.eval()
    with gathered(policy):
        lm = policy.lm
        # gathered: the compute dtype
        weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
        kv_token_bytes = kv_cache_bytes(lm.config, 1, 1, next(lm.parameters()).element_size())
        step = decode_step.DecodeStep(lm, V_)

        never_ends = Sampling(0, eos_token_id=V_, pad_token_id=tokenizer.pad_token_id,
                              vocab_size=V_)  # EOS id V_: never sampled

        def ours(written_out):
            return lambda batch, n: generate(
                lm, [prompt] * batch, replace(never_ends, max_new_tokens=n),
                generator=torch.Generator(device).manual_seed(0),
                written_out=written_out).response_ids
        ids = torch.tensor([prompt], device=device)

        def hf(batch, n):
            return lm.generate(ids.expand(batch, -1),
                               attention_mask=torch.ones_like(ids).expand(batch, -1),
                               do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]

        def measure(name, fn, batch, n, eager=None, first=(None, None)):
            """Seconds of fn(batch, n); a row of the table unless `name` is None (a warm-up or a
            capturing call)."""
            _reset_peak(device)
            seconds, response = _dev_timed(lambda: fn(batch, n), device)
            assert response.shape == (batch, n), response.shape
            if name is not None:
                # seconds a step
                roofline = (weight_bytes + batch * (P + n / 2) * kv_token_bytes) / bandwidth
                out.append({"part": "rollout", "sampler": name, "batch": batch, "new_tokens": n,
                            "seconds": seconds, "tokens_per_s": batch * n / seconds,
                            "step_ms": 1e3 * seconds / n, "roofline_ms": 1e3 * roofline,
                            "weight_gb": weight_bytes / 2**30,
                            "speedup": eager / seconds if eager else None,
                            "peak_gb": _peak_gb(device), "first_call_s": first[0],
                            "graphs": first[1]})
                print(f"{name} batch {batch}: {batch * n / seconds:,.0f} tokens/s, "
                      f"{1e3 * seconds / n:.2f} ms/step (roofline "
                      f"{1e3 * roofline:.2f} ms)", flush=True)
            return seconds

        measure(None, ours(False), largest, 16)
        eager = measure("model forward, eager", ours(False), largest, n_new)
        measure(None, ours(step), largest, 16)
        measure("DecodeStep, eager", ours(step), largest, n_new, eager)
        # one static cache for every batch, as in a phase
        captured = cuda_graphs.CapturedStep(step, largest, P + n_new)
        for batch in sizes.decode_batches:
            graphs = len(captured.graphs)
            # the call that captures this batch's graphs
            seconds = measure(None, ours(captured), batch, n_new)
            measure("CapturedStep", ours(captured), batch, n_new,
                    eager if batch == largest else None, (seconds, len(captured.graphs) - graphs))
        measure(None, hf, sizes.decode_batches[0], 16)
        measure("model.generate", hf, sizes.decode_batches[0], n_new)
        # the graphs' replay against the same body run eagerly (capture=False) on the same seeds, at
        # the same bucket and length blocks (the same cache length): the same tokens
        batch, n = sizes.decode_batches[0], min(64, n_new)
        a, b = (generate(lm, [prompt] * batch, replace(never_ends, max_new_tokens=n),
                         generator=torch.Generator(device).manual_seed(1), written_out=w)
                for w in (captured,
                          cuda_graphs.CapturedStep(step, batch, P + n_new, capture=False)))
        out.append({"part": "captured_check", "batch": batch, "new_tokens": n,
                    "same_tokens": torch.equal(a.response_ids, b.response_ids),
                    "logprob_max_abs_diff":
                        (a.sampler_logprobs - b.sampler_logprobs).abs().max().item()})
        print(f"CapturedStep replayed vs its body run eagerly, {batch} x {n}: same tokens "
              f"{out[-1]['same_tokens']}, log-prob max diff "
              f"{out[-1]['logprob_max_abs_diff']:.2e}", flush=True)
        del captured, step


def gpu_e2e(sizes, model_dir, data, device, work, out):
    """`train.main` for a few steps on the saved random model; rewards by response-length parity (a
    random model's responses are never right, and all-wrong groups skip every update)."""
    from unittest import mock

    flags = dict(sizes.e2e, model=model_dir, data=data, prompt_key="prompt", answer_key="answer",
                 instruction="", preset="paper", out_dir=str(work / "e2e"), save_every=0,
                 warmup_steps=0)
    # --cuda-graphs: the captured sampler's first run inside train.py
    argv = (["--no-chat", "--no-export-hf", "--no-plots", "--grad-checkpointing", "--cuda-graphs"]
            + (["--fsdp"] if device.type == "cpu" else []))
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    def parity(response, gold, mode="dapo"):
        return 1.0 if len(response) % 2 else -1.0

    with mock.patch.object(reward, "reward", parity):
        seconds, code = _dev_timed(lambda: train.main(argv), device)
    assert code == 0, f"train.main exited with {code}"
    lines = [json.loads(x) for x in (work / "e2e" / "metrics.jsonl").read_text().splitlines()
             if x.strip()]
    keys = ("step", "reward/mean", "response/len_mean", "entropy/mean", "rollout/logprob_diff",
            "loss/policy", "grad_norm", "updates", "time/rollout_s", "time/update_s",
            "tokens_per_s")
    for m in lines:
        out.append({"part": "e2e", **{k: m[k] for k in keys}, "wall_s": seconds})
        print("train.py metrics: "
              + ", ".join(f"{k}={m[k]:.4g}" if isinstance(m[k], float) else f"{k}={m[k]}"
                          for k in keys), flush=True)
