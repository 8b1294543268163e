"""Realistic batches, generated on each replica leader: what RL and pretraining frameworks
actually hand to ``get_data_input``. Each is sized by batch_size (B) and seq_len (S).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDict

from harness.payload.sizes import PATCH_DIM
from strategies import NON_TENSOR_FLAG, DataProto

VOCAB = 151_936  # Qwen2's vocabulary, as in ROLL's and verl's examples


def _meta(batch_size: int, broadcast_non_tensor: bool) -> dict:
    return {
        "global_step": 100,
        "micro_batch_size": max(1, batch_size // 4),
        "temperature": 1.0,
        "sampling": {"top_p": 0.99, "top_k": -1, "stop": ["</s>", None]},
        NON_TENSOR_FLAG: broadcast_non_tensor,
    }


def _texts(gen: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
    words = np.array(["solve", "the", "integral", "of", "x", "prove", "that", "为什么", "π", "∑"])
    prompts = np.empty(batch_size, dtype=object)
    uids = np.empty(batch_size, dtype=object)
    for i in range(batch_size):
        prompts[i] = " ".join(gen.choice(words, size=int(gen.integers(4, 24))))
        uids[i] = str(uuid.UUID(int=int(gen.integers(0, 2**63)), version=4))
    return {"prompt_text": prompts, "uid": uids}


def rl_rollout(
    batch_size: int, seq_len: int, seed: int, broadcast_non_tensor: bool = True
) -> DataProto:
    """A PPO/GRPO batch as ROLL and verl carry it (prompt = first half, response = second)."""
    g = torch.Generator().manual_seed(seed)
    b, s = batch_size, seq_len
    r = s // 2
    input_ids = torch.randint(0, VOCAB, (b, s), generator=g)
    attention_mask = torch.ones(b, s, dtype=torch.int64)
    pad = torch.randint(0, max(1, s // 8), (b,), generator=g)
    attention_mask[torch.arange(s) < pad[:, None]] = 0  # left padding
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    response_mask = attention_mask[:, -r:].clone()

    def logp():
        return -torch.rand(b, r, generator=g) * 5

    td = TensorDict(
        {
            "prompts": input_ids[:, : s - r].clone(),
            "responses": input_ids[:, -r:].clone(),
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": logp(),
            "ref_log_probs": logp(),
            "advantages": torch.randn(b, r, generator=g),
            "returns": torch.randn(b, r, generator=g),
            "token_level_rewards": torch.randn(b, r, generator=g) * response_mask,
        },
        batch_size=[b],
    )
    gen = np.random.default_rng(seed)
    return DataProto(td, _texts(gen, b), _meta(b, broadcast_non_tensor))


def pretrain(
    batch_size: int, seq_len: int, seed: int, broadcast_non_tensor: bool = False
) -> DataProto:
    """Megatron's GPT batch: tokens, labels, loss_mask, position_ids."""
    g = torch.Generator().manual_seed(seed)
    b, s = batch_size, seq_len
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    td = TensorDict(
        {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (torch.rand(b, s, generator=g) > 0.05).float(),
            "position_ids": torch.arange(s).expand(b, s).contiguous(),
        },
        batch_size=[b],
    )
    return DataProto(td, {}, _meta(b, broadcast_non_tensor))


def multimodal(
    batch_size: int, seq_len: int, seed: int, broadcast_non_tensor: bool = True
) -> DataProto:
    """An RL rollout of a vision-language model: adds bf16 pixel patches and image grid sizes."""
    dp = rl_rollout(batch_size, seq_len, seed, broadcast_non_tensor)
    g = torch.Generator().manual_seed(seed + 1)
    patches = max(4, seq_len // 4)
    dp.batch["pixel_values"] = torch.randn(batch_size, patches, PATCH_DIM, generator=g).bfloat16()
    side = max(1, int(patches**0.5))
    dp.batch["image_grid_thw"] = torch.tensor([[1, side, patches // side]] * batch_size)
    return dp


PAYLOADS: dict[str, Callable[..., DataProto]] = {
    "rl_rollout": rl_rollout,
    "pretrain": pretrain,
    "multimodal": multimodal,
}


def make(
    name: str,
    batch_size: int,
    seq_len: int,
    seed: int,
    broadcast_non_tensor: bool | None = None,
):
    """A generated batch of ``batch_size`` rows × ``seq_len`` tokens, seeded: what a replica
    leader holds. A recorded payload (file, schema) is ``harness.payload.source``'s."""
    try:
        fn = PAYLOADS[name]
    except KeyError:
        raise KeyError(
            f"unknown generated payload {name!r}; valid names: {sorted(PAYLOADS)}"
        ) from None
    kwargs = {} if broadcast_non_tensor is None else {"broadcast_non_tensor": broadcast_non_tensor}
    return fn(batch_size, seq_len, seed, **kwargs)
