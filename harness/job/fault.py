"""A job's injected fault (``fault.*``) as one value that checks itself: which rank misbehaves,
at which timed iteration, and how. It exists to prove that failures are reported, never hung,
and that a gate catches a known regression (``kind=delay``)."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("crash", "hang", "raise", "delay", "oom")
"""What ``Fault.rank`` does at ``Fault.at_iter`` (``harness.job.config_schema.FaultConf``)."""


@dataclass(frozen=True)
class Fault:
    """``rank`` -1 is no fault. Refused on construction when the kind is unknown or a delay
    has no microseconds; ``check_world`` refuses a rank outside the job's world and a delay
    of no rank."""

    rank: int = -1
    at_iter: int = -1
    kind: str = "crash"
    delay_us: int = 0
    """kind=delay: microseconds the fault rank adds to each of its calls."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "delay" and self.delay_us < 1:
            raise ValueError(
                f"fault.delay_us must be >= 1 with fault.kind=delay, got {self.delay_us}"
            )

    def check_world(self, world_size: int) -> None:
        """Refuse a rank that is not one of a world of ``world_size`` ranks, and a delay that
        names none."""
        if self.kind == "delay" and self.rank == -1:
            raise ValueError(
                "fault.kind=delay delays no rank while fault.rank=-1 (no fault); name the rank "
                f"whose calls take {self.delay_us} us longer: fault.rank=0..{world_size - 1}"
            )
        if self.rank >= world_size or self.rank < -1:
            raise ValueError(
                f"fault.rank={self.rank} is not a rank of the world of {world_size}; "
                f"valid: -1 (no fault) or 0..{world_size - 1}"
            )

    def delays(self, rank: int) -> bool:
        """Whether ``rank`` is a ``kind=delay`` job's fault rank."""
        return self.kind == "delay" and rank == self.rank

    def strikes(self, rank: int, it: int) -> bool:
        """Whether ``rank`` misbehaves at timed iteration ``it`` (a delay strikes every call:
        ``delays``)."""
        return self.kind != "delay" and rank == self.rank and it == self.at_iter
