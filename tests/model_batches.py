"""The small batches the model and training tests share: a left-padded prompt + right-padded
response batch of the tiny model (`model_batch`), and rows whose G responses share a prompt, for
packing (`packing_batch`)."""
import torch

from rollout import Rollout


def model_batch(seed=1):
    """A left-padded prompt (P=5) + right-padded response (T=6) batch for the tiny model."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = 3, 5, 6
    input_ids = torch.randint(4, 104, (B, P + T), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1],
                                  [1, 1, 0, 0, 0, 0]])  # (B, T)
    attention_mask = torch.cat([torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
                                response_mask], 1)
    return input_ids, attention_mask, response_mask


def packing_batch(seed=3):
    """6 rows, left-padded prompt + right-padded response: prompt A (5 tokens) in rows 0, 1, 2
    and 5, prompt B (1 token) in rows 3 and 4 (the G responses of a prompt share it, and
    rows 0-2 / 5 are not adjacent), responses of 1-7 tokens."""
    g = torch.Generator().manual_seed(seed)
    P, T = 5, 7
    prompt_len, resp_len = torch.tensor([5, 5, 5, 1, 1, 5]), torch.tensor([7, 2, 5, 1, 3, 6])
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P)
    response_mask = (torch.arange(T) < resp_len[:, None]).long()  # (B, T)
    prompts = torch.randint(4, 104, (2, P), generator=g)  # A, B
    prompt_ids = prompts[torch.tensor([0, 0, 0, 1, 1, 0])] * prompt_mask
    response_ids = torch.randint(4, 104, (6, T), generator=g) * response_mask
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(6, T),
                   torch.zeros(6, dtype=bool))
