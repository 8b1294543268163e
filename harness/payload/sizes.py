"""What a generated payload weighs, from its shapes alone (nothing allocated, no torch): the
bound a job is checked against before any rank generates it, and the batch sizes a size range
in bytes stands for (``sizes_for``, nccl-tests' ``-b -e -f``)."""

from __future__ import annotations

import re

PATCH_DIM = 1176  # Qwen2-VL: 3 channels × 2 frames × 14 × 14
GENERATED = ("rl_rollout", "pretrain", "multimodal")
"""The generated payloads (``harness.payload.generated.PAYLOADS``), by name."""


TEXT_BYTES_PER_ROW = 320
"""At most what one row of the generated text columns takes (a prompt of up to 23 short
words, a 36-character uid): the non-tensor part of ``payload_bytes``."""


def payload_bytes(name: str, batch_size: int, seq_len: int) -> int:
    """What a generated payload of ``batch_size`` rows × ``seq_len`` tokens takes, from its
    shapes alone (nothing allocated): the bound a job is checked against before any rank
    generates it. Tensors exactly; the text columns at ``TEXT_BYTES_PER_ROW``."""
    b, s = int(batch_size), int(seq_len)
    r = s // 2
    # rl_rollout, per row: five int64 leaves of s, s - r or r tokens (prompts + responses = s)
    # plus response_mask, and five float32 leaves of r.
    rollout = b * (8 * (4 * s) + 8 * r + 4 * 5 * r) + b * TEXT_BYTES_PER_ROW
    if name == "rl_rollout":
        return rollout
    if name == "pretrain":
        return b * s * (8 + 8 + 4 + 8)  # tokens, labels (int64), loss_mask (f32), positions
    if name == "multimodal":
        patches = max(4, s // 4)
        return rollout + b * patches * PATCH_DIM * 2 + b * 3 * 8  # bf16 patches, int64 grid
    raise KeyError(f"unknown generated payload {name!r}; valid names: {sorted(GENERATED)}")


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text) -> int:
    """``64K``, ``16M``, ``1G`` or a plain count, in bytes (powers of two, as nccl-tests')."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size: expected bytes like 65536, 64K, 16M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def sizes_for(name: str, seq_len: int, begin, end, factor) -> list[int]:
    """The batch sizes (rows) whose payload is nearest each of ``begin``, ``begin·factor``, ...
    up to ``end`` bytes (the last step may stop short of it), each once, growing."""
    low, high, step = parse_bytes(begin), parse_bytes(end), float(factor)
    if not (0 < low <= high) or step <= 1:
        raise ValueError(
            f"size range {begin}..{end} by {factor}: expected 0 < begin <= end and factor > 1"
        )
    per_row = payload_bytes(name, 1, seq_len)
    rows, size = [], float(low)
    while size <= high * (1 + 1e-9):
        rows.append(max(1, round(size / per_row)))
        size *= step
    return list(dict.fromkeys(rows))
