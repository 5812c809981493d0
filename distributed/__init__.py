"""The process group and its collectives, and FSDP2 sharding of the policy (model.py holds the
policy)."""
