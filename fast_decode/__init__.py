"""The plain sampler's fast decode step, beside the reference one in rollout.py (which imports
it): the written-out decode step and in-place KV cache (decode_step), and that step captured in
CUDA graphs (cuda_graphs)."""
