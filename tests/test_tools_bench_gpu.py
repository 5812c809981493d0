"""tools/bench/gpu.py: the prepared GPU check (`python -m tools.bench gpu`), at toy shapes on the
CPU."""
import json
import math

from tests.toy_task import one_thread


# ==================================================================================================
# tools/bench/gpu.py: the prepared GPU check, at toy shapes on the CPU
# ==================================================================================================
def test_bench_gpu_smoke(tmp_path):
    """`python -m tools.bench gpu --smoke` runs every part of the GPU check (so it cannot rot
    between GPU runs): the sharded fp32 forward equals an fp32 copy of the same weights, the chunked
    head the fp64 naive one, each sampler (the model's forward, the written-out step, the captured
    step's CPU stand-in, model.generate) makes exactly its tokens, the captured step's body gives
    the same tokens however it runs, and train.py makes its two steps with an update each."""
    from tools.bench import gpu

    with one_thread():
        gpu.bench_gpu(smoke=True, out=tmp_path)
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["train"] * 3 + ["numerics"] * 2 + ["head"] * 2 + \
        ["rollout"] * 5 + ["captured_check"] + ["e2e"] * 2
    assert [(r["sampler"], r["batch"]) for r in rows if r["part"] == "rollout"] == [
        ("model forward, eager", 4), ("DecodeStep, eager", 4), ("CapturedStep", 2),
        ("CapturedStep", 4), ("model.generate", 2)]
    for r in rows:
        if r["part"] == "train":
            assert r["updates"] == 1 and math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and \
                r["mfu"] > 0
        elif r["part"] == "numerics":
            assert r["max_abs_diff"] < 1e-5 and r["tokens"] == 32
        elif r["part"] == "head":
            assert r["logprob_max_abs_diff"] < 1e-4 and r["entropy_max_abs_diff"] < 1e-4
        elif r["part"] == "rollout":
            assert r["new_tokens"] == 8 and r["step_ms"] > 0 and r["roofline_ms"] > 0
            assert (r["speedup"] is not None) == (r["batch"] == 4
                                                  and r["sampler"] != "model forward, eager")
            assert (r["graphs"] is None) != (r["sampler"] == "CapturedStep")
        elif r["part"] == "captured_check":
            assert r["same_tokens"] and r["logprob_max_abs_diff"] == 0
        else:
            assert r["updates"] == 1 and 1 <= r["response/len_mean"] <= 8  # --max-response-len 8
    table = (tmp_path / "gpu.md").read_text()
    assert table.startswith("python -m tools.bench gpu --smoke: CPU, torch ")
    assert "| one mini-batch update |" in table and "| train.py step |" in table and \
        "vLLM: not measured" in table
    # --parts: only those; the table is written after each (a run cut short keeps what it measured)
    gpu.bench_gpu(smoke=True, out=tmp_path / "some", parts=("numerics",))
    assert {r["part"] for r in json.loads((tmp_path / "some" / "gpu.json").read_text())["rows"]} \
        == {"numerics", "head"}
