"""verl 0.9.1's own DataProto and worker payload for the interop tests, built by verl's own
functions. verl imports ray and transformers at import time for two names (``ray.ObjectRef``,
``transformers.PreTrainedTokenizer``) the DataProto path never uses; where the real packages
are absent, two bare stand-in modules holding just those names are registered (test tree
only), so ``pip install --no-deps verl==0.9.1`` is the whole install. Tests skip when verl is
not installed.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

NON_TENSOR_FLAG = "_broadcast_non_tensor_batch"


def _stand_in(module: str, name: str) -> None:
    if module in sys.modules or importlib.util.find_spec(module) is not None:
        return  # the real package is installed: use it
    stub = types.ModuleType(module)
    stub.__doc__ = f"Test-only stand-in: verl imports {module}.{name} and never uses it here."
    setattr(stub, name, type(name, (), {}))
    sys.modules[module] = stub


def verl_modules():
    """(verl.protocol, verl.workers.utils.padding), or a pytest skip naming the install."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    _stand_in("ray", "ObjectRef")
    _stand_in("transformers", "PreTrainedTokenizer")
    from verl import protocol
    from verl.workers.utils import padding

    return protocol, padding


def verl_dataproto(b: int, seed: int, flag: bool):
    """A left-right padded rollout batch as verl's trainer holds it (prompt + response)."""
    protocol, _ = verl_modules()
    g = torch.Generator().manual_seed(seed)
    prompt, response = 4, 5
    ids = torch.randint(0, 32000, (b, prompt + response), generator=g)
    attn = torch.ones(b, prompt + response, dtype=torch.int64)
    for i in range(b):  # left padding of the prompt, right padding of the response
        attn[i, : i % prompt] = 0
        attn[i, prompt + response - (i % response) :] = 0
        attn[i, prompt] = 1  # at least one token each
    return protocol.DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "response_mask": attn[:, prompt:].clone(),
            "old_log_probs": torch.randn(b, response, generator=g),
        },
        non_tensors={
            "uid": np.array([f"uid-{seed}-{i}" for i in range(b)], dtype=object),
            "raw_prompt": np.array([f"prompt {i}" for i in range(b)], dtype=object),
        },
        meta_info={"global_step": seed, "temperature": 1.0, NON_TENSOR_FLAG: flag},
    )


def verl_worker_payload(b: int, seed: int):
    """What verl 0.9.1's trainer ships each worker: left_right_2_no_padding(to_tensordict()),
    a TensorDict with jagged NestedTensor and NonTensorData/NonTensorStack leaves, handed to
    get_data_input as the batch of a verl DataProto."""
    protocol, padding = verl_modules()
    td = padding.left_right_2_no_padding(verl_dataproto(b, seed, False).to_tensordict())
    return protocol.DataProto(batch=td, non_tensor_batch={}, meta_info={"global_step": seed})


def receiver_entry(leader_obj):
    """The entry state of a non-leader rank, in the leader's own class."""
    return type(leader_obj)(batch=None, non_tensor_batch={}, meta_info=dict(leader_obj.meta_info))
