"""The rollout's fast paths beside the reference sampler (rollout.py): the written-out decode step and in-place KV
cache, CUDA graphs, the vLLM engine, and `make_engine`, which picks one by name."""
