"""The rollout engines train.py and eval.py sample with (--rollout), above rollout.py: the choice
of an engine by name and its size for a run (choice: 'plain' is rollout.PlainEngine, the
reference sampler), and the optional colocated vLLM engine (vllm_engine)."""
