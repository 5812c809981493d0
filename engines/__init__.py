"""The rollout engines train.py and eval.py sample with (--rollout), above rollout.py: the choice
of an engine by name and its size for a run (choice), the plain engine, rollout.py's reference
sampler on the policy's weights (plain_engine), and the optional colocated vLLM engine
(vllm_engine)."""
