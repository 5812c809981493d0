"""run_folder/checkpoints.py: a checkpoint's DCP shards, its manifest and a tied weight stored once.
"""
import json

import torch
import torch.distributed as dist

import run_folder
from model import Policy, tiny_model


# ==================================================================================================
# run_folder/checkpoints.py: save_checkpoint, verified_checkpoint, load_checkpoint
# ==================================================================================================
def test_checkpoint_stores_a_tied_weight_once_and_restores_it(tmp_path):
    """Tied embeddings (SmolLM2's, Qwen3-1.7B's): the checkpoint holds the weight under its first
    name only (113 MB less for SmolLM2) and the load restores both names to the saved values, still
    one tensor; the manifest lists every file with its size and CRC-32."""
    lm = tiny_model()
    lm.config.tie_word_embeddings = True
    lm.tie_weights()
    policy = Policy(lm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trained = run_folder.ModelAndOptimizer(policy, optimizer, scheduler)
        settings = {"save_optimizer": True, "keep_checkpoints": 1}
        run_folder.save_checkpoint(tmp_path, 1, trained, settings, 0, 1)
        import torch.distributed.checkpoint as dcp
        names = dcp.FileSystemReader(
            str(tmp_path / "checkpoint" / "step_1")).read_metadata().state_dict_metadata
        assert "model.lm.model.embed_tokens.weight" in names and \
            "model.lm.lm_head.weight" not in names, list(names)
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
        done, path = run_folder.verified_checkpoint(tmp_path, 0, 1)
        assert (done, path.name) == (1, "step_1")
        run_folder.load_checkpoint(path, trained)
    finally:
        dist.destroy_process_group()
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)
    assert policy.lm.lm_head.weight is policy.lm.model.embed_tokens.weight
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert all(size == (path / n).stat().st_size for n, (size, _) in manifest.items())
