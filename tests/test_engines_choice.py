"""engines/choice.py: the rollout engine by name (make_engine) and what it hands the engine.
"""
import torch

import rollout
from engines import choice
from model import tiny_model, tiny_tokenizer
from rollout import Sampling, format_prompt, sample_groups
from tests.sampler_checks import REAL_VOCAB


# ==================================================================================================
# engines/choice.py: make_engine
# ==================================================================================================
def test_plain_engine_passes_the_stop_text():
    """make_engine(stop_text=...) gives the plain engine the texts; its rows end
    where `generate`'s do."""
    tok = tiny_tokenizer()
    lm = tiny_model()
    prompts = [format_prompt(tok, p, chat=False, instruction="") for p in ("12", "ab", "x y")]
    engine = choice.make_engine("plain", lm, tok, chat=False, stop_text=["e", " t"])
    with engine.ready(lm):
        got = engine.sample(prompts, 2, [7], 3, 20, 1.0, 1.0)
    sampling = Sampling(20, eos_token_id=engine.eos, pad_token_id=engine.pad, vocab_size=REAL_VOCAB,
                        stop_text=rollout.StopText(tok, ["e", " t"]))
    want = sample_groups(lm, prompts, 2, sampling, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got.response_ids, want.response_ids) and \
        torch.equal(got.response_mask, want.response_mask)
    assert any("e" in t or " t" in t for t in got.texts(tok))
