"""Attention inside the policy's forward, below model.py (which imports it): the packed rows' and
the sampler's attention implementation, registered with transformers (packed_sdpa)."""
