"""Performance measurements, printed as markdown tables; ratios against a baseline run in the same
process (docs/performance.md, docs/rollouts.md, docs/memory.md, docs/gpu.md).

    python -m tools.bench [MODE ...]   # default: every mode but gpu (about an hour on 2 CPU cores)
    python -m tools.bench gpu --smoke
        # the GPU check's code at toy shapes on the CPU (the test suite)

Modes: logprobs (chunked log-prob/entropy vs naive, at Qwen3's vocabulary), generate (our sampler vs
model.generate; FSDP2 vs one process), grader (reward.grade throughput), grader-compare [--against
OLD_REWARD_PY] (reward.grade vs math-verify on the peers' suites), gpu [--smoke] [--parts
numerics,rollout] (the CUDA path at Qwen3-1.7B shape on one GPU, ~7 min on an H200), update
(token-budget vs sequence-count micro-batches; peak memory vs the estimate), engines [--against
OLD_ROLLOUT_PY] (the plain sampler vs vLLM-CPU; the matmul limit), decode-step (one decode step
against its matmuls alone), train-step (the CPU default step, plain vs vllm), flops (the CPU
default's update: FLOP rate by token budget), preempt (the CPU default stopped by SIGTERM / SIGUSR1,
resumed: signal -> exit, equality). One file per mode (MODE.py), shared helpers in harness.py.

Not part of the test suite: timings on a shared machine are noisy, so nothing here asserts a speed.
Each bench function's docstring says what it measures and its deliberate choices.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # benchmarks never download (GPU machine: no network)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
