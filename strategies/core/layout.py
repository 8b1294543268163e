"""Parallel layouts (dp × pp × tp × cp + Megatron's order string) and their rank maths.

Pure functions, no process group: the same groups megatron-core's ``RankGenerator`` builds,
computed with numpy so they can be checked at 16k ranks in milliseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
SEED_ORDER = "tp-cp-ep-pp-dp"


class LayoutError(ValueError):
    """A layout that cannot exist, or does not fit the world it is given."""


@dataclass(frozen=True)
class Layout:
    """A DP × PP × TP × CP layout in Megatron's rank order."""

    dp: int = 1
    """Data-parallel replicas; each replica gets its own batch."""
    pp: int = 1
    """Pipeline stages per replica."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    cp: int = 1
    """Context-parallel ranks per stage (sequence split into 2·cp chunks)."""
    order: str = DEFAULT_ORDER
    """Megatron's order string, fastest-varying axis first (``tp-cp-ep-dp-pp`` is Megatron's
    default; ``tp-cp-ep-pp-dp`` is the seed's, where DP is the slowest axis)."""
    tokens: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp", "cp"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise LayoutError(f"layout.{axis} must be a positive integer, got {value!r}")
        tokens = [t.strip().lower() for t in str(self.order).split("-") if t.strip()]
        unknown = [t for t in tokens if t not in AXES]
        if unknown:
            raise LayoutError(
                f"layout.order {self.order!r} has unknown axes {unknown}; valid axes are {list(AXES)}"
            )
        dupes = sorted({t for t in tokens if tokens.count(t) > 1})
        if dupes:
            raise LayoutError(f"layout.order {self.order!r} names {dupes} more than once")
        for axis in ("tp", "cp", "dp", "pp"):
            if axis not in tokens:
                if getattr(self, axis) != 1:
                    raise LayoutError(
                        f"layout.order {self.order!r} omits {axis} but layout.{axis}="
                        f"{getattr(self, axis)}; every axis larger than 1 must be ordered"
                    )
                tokens.append(axis)  # Megatron appends omitted size-1 axes the same way
        if "ep" not in tokens:
            tokens.append("ep")
        object.__setattr__(self, "tokens", tuple(tokens))

    # -- sizes ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def replica_size(self) -> int:
        """Ranks that must end with the same batch: tp·cp·pp."""
        return self.pp * self.tp * self.cp

    @property
    def tp_cp(self) -> int:
        return self.tp * self.cp

    def size(self, axis: str) -> int:
        return 1 if axis == "ep" else getattr(self, axis)

    def describe(self) -> str:
        return f"dp{self.dp}×pp{self.pp}×tp{self.tp}×cp{self.cp} ({'-'.join(self.tokens)})"

    def check_world(self, world_size: int) -> None:
        """Raise with the arithmetic when the layout does not fill ``world_size`` exactly."""
        if self.world_size != world_size:
            raise LayoutError(
                f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) * cp({self.cp}) = "
                f"{self.world_size} != WORLD_SIZE({world_size})"
            )

    # -- rank maths ------------------------------------------------------------------------
    def groups(self, axes: str) -> list[list[int]]:
        """Rank groups varying over ``axes`` (e.g. ``"tp-cp"``), in Megatron's group order."""
        return rank_groups(self.tokens, {t: self.size(t) for t in self.tokens}, axes)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every axis (what ``mpu.get_*_rank()`` return)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of {self.world_size}")
        out = {}
        rest = rank
        for t in self.tokens:
            size = self.size(t)
            out[t] = rest % size
            rest //= size
        return out

    def stage0_tp_cp_groups(self) -> list[list[int]]:
        """TP×CP groups of pipeline stage 0, one per replica."""
        return [g for g in self.groups("tp-cp") if self.coords(g[0])["pp"] == 0]

    def seed_hop_groups(self) -> list[list[list[int]]]:
        """The seed's hops, each as the groups that run it at once: stage 0's TP×CP groups
        when tp·cp > 1, then every PP group when pp > 1 (``ProcessGroups.seed_hops`` is the
        same order seen from one rank)."""
        hops = []
        if self.tp_cp > 1:
            hops.append(self.stage0_tp_cp_groups())
        if self.pp > 1:
            hops.append(self.groups("pp"))
        return hops

    def group_of(self, axes: str, rank: int) -> list[int]:
        for g in self.groups(axes):
            if rank in g:
                return g
        raise LayoutError(f"rank {rank} is in no {axes} group")  # unreachable for valid ranks

    def replica_groups(self) -> list[list[int]]:
        """All tp·cp·pp ranks of each DP replica, leader first."""
        return self.groups("tp-cp-pp")

    def leaders(self) -> list[int]:
        """Global rank of each replica's leader (tp = cp = pp = 0)."""
        return [g[0] for g in self.replica_groups()]

    # -- megatron-core ---------------------------------------------------------------------
    def megatron_kwargs(self) -> dict:
        """Arguments for ``parallel_state.initialize_model_parallel`` that reproduce this layout.

        megatron-core asserts that an order not ending in ``pp`` gives the MoE layers the same
        DP size as the dense ones; its expert DP is world/(etp·ep·pp), so with CP > 1 the
        expert TP size must absorb CP (etp = tp·cp). No expert layers run here, so this changes
        no dense group.
        """
        kwargs = dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp,
            order="-".join(self.tokens),
        )
        pp_groups = self.groups("pp")
        for etp in dict.fromkeys((self.tp, self.tp * self.cp)):
            edp = self.world_size // (etp * self.pp)
            expert = {**{t: self.size(t) for t in self.tokens}, "tp": etp, "cp": 1, "dp": edp}
            same_dp = self.tokens[-1] == "pp" or edp == self.dp
            if same_dp and rank_groups(self.tokens, expert, "pp") == pp_groups:
                if etp != self.tp:
                    kwargs["expert_tensor_parallel_size"] = etp
                return kwargs
        raise LayoutError(
            f"megatron-core cannot build order {'-'.join(self.tokens)!r} with cp={self.cp} > 1 "
            f"and pp={self.pp}: its expert rank generator (CP folded into expert TP) gives other "
            "PP groups than the dense one, so initialize_model_parallel would assert; put cp "
            "right after tp (e.g. tp-cp-ep-dp-pp or tp-cp-ep-pp-dp)"
        )


def leader_pp_groups(layout) -> list[list[int]]:
    """The PP group of each replica leader (the stage leaders of each replica)."""
    leaders = set(layout.leaders())
    return [g for g in layout.groups("pp") if g[0] in leaders]


def rank_groups(tokens: tuple[str, ...], sizes: dict[str, int], axes: str) -> list[list[int]]:
    """Megatron's ``generate_masked_orthogonal_rank_groups`` for an order (fastest token first)
    and per-axis sizes, vectorised with numpy."""
    wanted = [a.strip().lower() for a in axes.split("-") if a.strip()]
    for a in wanted:
        if a not in AXES:
            raise LayoutError(f"unknown axis {a!r} in {axes!r}; valid axes are {list(AXES)}")
    n = len(tokens)
    world = math.prod(sizes[t] for t in tokens)
    # C order makes the last axis fastest; Megatron's first token is fastest, so reverse.
    grid = np.arange(world, dtype=np.int64).reshape([sizes[t] for t in tokens][::-1])
    axis_of = {t: n - 1 - i for i, t in enumerate(tokens)}
    masked = [axis_of[t] for t in tokens if t in wanted]
    unmasked = [axis_of[t] for t in tokens if t not in wanted]
    # Groups enumerate unmasked coords, members enumerate masked coords; both with the first
    # token fastest, i.e. grid axes in descending order as the C-order tail.
    perm = sorted(unmasked) + sorted(masked)
    group_size = math.prod(sizes[t] for t in tokens if t in wanted)
    return np.transpose(grid, perm).reshape(-1, group_size).tolist()


def parse_layout(spec: str, order: str = DEFAULT_ORDER) -> Layout:
    """``"tp2pp2dp2"`` -> Layout(dp=2, pp=2, tp=2). Axes may come in any order."""
    parts = re.findall(r"(dp|pp|tp|cp)(\d+)", spec.lower())
    if not parts or "".join(a + n for a, n in parts) != spec.lower():
        raise LayoutError(f"cannot parse layout {spec!r}; expected e.g. 'tp2pp2dp2'")
    return Layout(**{a: int(n) for a, n in parts}, order=order)
