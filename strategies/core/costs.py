"""What a price says: the typed records of one plan's predicted cost (one collective, one step,
one role's host work) and the ``Prediction`` they add up to, with its rows and summary.

``strategies.core.pricing`` fills them; a report reads them. Pure: no process group, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

LinkName = Literal["intra", "inter", "none"]


@dataclass(frozen=True)
class CommCost:
    """The price of one collective as issued in its step."""

    step: int
    kind: str
    what: str
    group_size: int
    first_rank: int
    """Lowest global rank of the group (names the group in a report)."""
    nbytes: int
    link: LinkName
    """'intra', 'inter' (the group spans nodes; a tree broadcast pays inter only in the rounds
    whose edges cross), or 'none' for a group of one."""
    nodes: int
    """Distinct nodes the group touches."""
    nic_share: float
    """How many flows share each port at the busiest node the group touches (≥ 1); the β term
    is multiplied by it."""
    alpha_s: float
    """Latency term a·α."""
    beta_s: float
    """Bandwidth term b·β·nic_share."""
    exact: bool

    @property
    def total_s(self) -> float:
        return self.alpha_s + self.beta_s


@dataclass(frozen=True)
class StepCost:
    """One step: concurrent collectives on disjoint groups; the slowest sets the pace."""

    step: int
    critical: CommCost
    """The slowest collective of the step."""
    n_comms: int
    n_inter: int
    """How many of the step's collectives cross nodes."""
    max_nic_share: float

    @property
    def total_s(self) -> float:
        return self.critical.total_s


LOCAL_TERMS = (
    "pickle_s",
    "unpickle_s",
    "memcpy_s",
    "d2h_s",
    "h2d_s",
    "calls_s",
    "signal_s",
    "store_s",
)
"""The terms of ``LocalCost``, each in seconds: what ``total_s`` adds up, and what CPU
oversubscription scales."""


@dataclass(frozen=True)
class LocalCost:
    """Work one role does off the network, priced from ``LocalWork`` and the host throughputs."""

    role: Literal["leader", "forwarder", "receiver"]
    pickle_s: float
    unpickle_s: float
    memcpy_s: float
    """``packed_bytes`` + ``copied_bytes`` at ``ClusterConf.pack_copy_bytes_per_s``."""
    d2h_s: float
    h2d_s: float
    calls_s: float = 0.0
    """Fixed per-call host overhead (pickle/unpickle/pack/unpack calls, see ``host_calls``)."""
    signal_s: float = 0.0
    """Shared-memory signals on the critical path (``handoff_signals`` × ``signal_s``; leader)."""
    store_s: float = 0.0
    """A pull strategy's store put and contended gets on the critical path
    (``strategies.core.store_pricing.store_s``; receiver)."""

    @property
    def total_s(self) -> float:
        return sum(getattr(self, term) for term in LOCAL_TERMS)


@dataclass(frozen=True)
class Prediction:
    """What ``price`` says about one plan on one cluster."""

    strategy: str
    cluster: str
    layout: str
    total_s: float
    """Critical path: leader work + Σ steps (slowest comm each) + forwarder + receiver work."""
    comm_s: float
    local_s: float
    alpha_s: float
    """Latency share of comm_s (sum over steps of the critical comm's α term)."""
    beta_s: float
    """Bandwidth share of comm_s, NIC sharing included."""
    inter_s: float
    """Part of comm_s spent in steps whose critical comm crosses nodes."""
    steps: tuple[StepCost, ...]
    local: tuple[LocalCost, ...]
    exact: bool
    """False when any comm's size was an estimate."""
    oversubscription: float = 1.0
    """CPU time-slicing factor already applied to every term (``ClusterConf.oversubscription``)."""

    def dominant(self) -> str:
        """One phrase for a report: which link and which term dominate the total."""
        if self.total_s <= 0:
            return "nothing to do"
        store = sum(w.store_s for w in self.local)
        parts = {"local work": self.local_s - store, "store put/get": store}
        for link in ("intra", "inter"):
            steps = [s for s in self.steps if s.critical.link == link]
            parts[f"{link}-node α"] = sum(s.critical.alpha_s for s in steps)
            parts[f"{link}-node β"] = sum(s.critical.beta_s for s in steps)
        name, value = max(parts.items(), key=lambda kv: kv[1])
        return f"{name} ({100 * value / self.total_s:.0f}% of {self.total_s * 1e3:.3g} ms)"

    def rows(self) -> list[dict[str, Any]]:
        """One row per step and per local role, for a pandas DataFrame."""
        out: list[dict[str, Any]] = []
        for s in self.steps:
            c = s.critical
            out.append(
                self._row(f"step {s.step}")
                | _columns(c, "kind", "what", "link", "group_size", "nodes", "nbytes")
                | _columns(s, "n_comms", "n_inter")
                | _columns(c, "nic_share", "alpha_s", "beta_s", "total_s", "exact")
            )
        for w in self.local:
            out.append(
                self._row(f"local {w.role}")
                | dict(
                    kind="local",
                    what="pickle/unpickle/copy/d2h/h2d/calls/signals/store",
                    link="host",
                    alpha_s=0.0,
                    beta_s=w.total_s,
                    total_s=w.total_s,
                    exact=True,
                )
            )
        return out

    def _row(self, part: str) -> dict[str, Any]:
        """The columns that name a row: this prediction's strategy and cluster, and the part."""
        return dict(strategy=self.strategy, cluster=self.cluster, part=part)

    def summary(self) -> str:
        over = self.oversubscription
        lines = [
            f"{self.strategy} on {self.cluster} ({self.layout}): {self.total_s * 1e3:.4g} ms"
            f"{'' if self.exact else ' (estimated sizes)'}; dominated by {self.dominant()}"
            + (f"; ×{over:.3g} CPU oversubscription included" if over != 1 else "")
        ]
        for s in self.steps:
            c = s.critical
            lines.append(
                f"  step {s.step}: {c.kind} {c.what} {c.nbytes} B over {c.group_size} ranks "
                f"on {c.link} ({c.nodes} nodes, {s.n_comms} groups, share {c.nic_share:g}): "
                f"α {c.alpha_s * 1e3:.4g} ms + β {c.beta_s * 1e3:.4g} ms"
            )
        for w in self.local:
            if w.total_s:
                lines.append(f"  local {w.role}: {w.total_s * 1e3:.4g} ms")
        return "\n".join(lines)


def _columns(record, *names: str) -> dict[str, Any]:
    """``record``'s attributes ``names`` as row columns, in that order."""
    return {name: getattr(record, name) for name in names}
