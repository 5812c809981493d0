"""distributed/sharding.py: FSDP2 sharding of the policy on 2 processes (torchrun, gloo) against the
unsharded policy, the weights read on every rank or on rank 0 only (`from_rank0`).
"""
import os
import subprocess
import sys
import textwrap

import torch

from tests.model_batches import model_batch
from tests.toy_task import ROOT


# ==================================================================================================
# distributed/sharding.py: shard_policy, from_rank0
# ==================================================================================================
_FSDP_SCRIPT = textwrap.dedent('''
    """Run by torchrun with 2 gloo processes: the FSDP2-sharded Policy equals the plain one."""
    import os
    import sys
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    import model
    from distributed import sharding

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch_file, out_dir = sys.argv[1], sys.argv[2]
    input_ids, attention_mask, response_mask = torch.load(batch_file)
    input_ids = torch.cat([input_ids, input_ids.flip(0)])  # 6 rows, 3 per rank
    attention_mask, response_mask = torch.cat([attention_mask, attention_mask.flip(0)]), torch.cat(
        [response_mask, response_mask.flip(0)])
    # a generic loss
    weights = torch.linspace(-1, 1, response_mask.numel()).reshape(response_mask.shape)
    rows = slice(3 * rank, 3 * rank + 3)

    def make_lm(tied):
        lm = model.tiny_model()
        if tied:  # SmolLM2-style shared embedding / LM head
            lm.config.tie_word_embeddings = True
            lm.lm_head.weight = lm.model.embed_tokens.weight
        return lm

    for tied, once in ((False, False), (True, False), (False, True), (True, True)):
        reference = model.Policy(make_lm(tied))
        ref_logprobs, ref_entropy, _ = reference(input_ids, attention_mask, response_mask,
                                                 chunk_size=5)
        # FSDP2 averages gradients over the 2 ranks
        (0.5 * (weights * ref_logprobs).sum()).backward()

        # read on rank 0 only; rank 1 builds it on the meta device and receives its shards (and
        # buffers)
        if once:
            lm, _ = sharding.from_rank0(lambda: (make_lm(tied), model.tiny_tokenizer()))
            assert (rank == 0) != (lm.lm_head.weight.device.type == "meta")
            assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
            sharded = sharding.shard_policy(model.Policy(lm), from_rank0=True, device="cpu")
        else:  # every rank reads the same weights
            # CPU: stays fp32
            sharded = sharding.shard_policy(model.Policy(make_lm(tied)), mixed_precision=True)
        logprobs, entropy, _ = sharded(input_ids[rows], attention_mask[rows], response_mask[rows],
                                       chunk_size=5)
        (weights[rows] * logprobs).sum().backward()
        gathered = [torch.zeros_like(logprobs) for _ in range(2)]
        dist.all_gather(gathered, logprobs.detach())
        torch.testing.assert_close(torch.cat(gathered), ref_logprobs.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy[rows], atol=1e-5, rtol=0)

        ref_params = dict(reference.named_parameters())
        names = [name for name, _ in sharded.named_parameters()]
        # tied: one shared parameter, named after the embedding
        assert ("lm.lm_head.weight" in names) != tied
        for name, param in sharded.named_parameters():
            assert param.dtype == torch.float32
            torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad, atol=1e-5,
                                       rtol=1e-4, msg=lambda m: f"{name}: {m}")

        model.save_hf(sharded, model.tiny_tokenizer(), out_dir)
        if rank == 0:
            reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
            with torch.no_grad():
                torch.testing.assert_close(reloaded(input_ids).logits,
                                           reference.lm(input_ids).logits, atol=0, rtol=0)
            print("FSDP2 OK", "tied" if tied else "untied", "once" if once else "every rank")
    # an error reading the model on rank 0 is raised on every rank (none waits for weights that
    # never come)
    try:
        sharding.from_rank0(lambda: model.load_model(out_dir + "-missing"))
    except FileNotFoundError as e:
        # one write: the ranks' lines do not interleave
        sys.stdout.write(f"raised on rank {rank}: {e}\\n")
        sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as train.py does: no interpreter teardown racing torch's gloo threads
''')


def test_model_fsdp2_two_processes_match_unsharded(tmp_path):
    """torchrun, 2 gloo ranks: log-probs, entropy and every gradient (LM head included, tied or not)
    of the sharded Policy equal the unsharded ones, and save_hf from the sharded model reloads to
    identical logits; so when the model is read on rank 0 only and the other rank builds it on the
    meta device (sharding.from_rank0)."""
    script = tmp_path / "fsdp_check.py"
    script.write_text(_FSDP_SCRIPT)
    torch.save(model_batch(), tmp_path / "batch.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(tmp_path / "batch.pt"), str(tmp_path / "saved")], capture_output=True,
        text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for case in ("untied every rank", "tied every rank", "untied once", "tied once"):
        assert f"FSDP2 OK {case}" in result.stdout, result.stdout
    assert "raised on rank 0" in result.stdout and "raised on rank 1" in result.stdout
