"""The calibration's fit: α and β per collective in the cost model's own form, least squares
in relative error, the host's rates and fixed per-call costs, and the ``local`` cluster file
they make. Pure: the measurements come from ``bcastbench calibrate``
(``harness.commands.calibrate``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.files import write_atomic
from harness.model.least_squares import relative_fit
from strategies.core.cluster import GB, US, ClusterConf, LinkConf
from strategies.core.formulas import (
    ALLGATHER_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    SCATTER_ALGORITHMS,
    coefficients,
)

ALGORITHMS = {
    "broadcast": ("broadcast_algorithm", BROADCAST_ALGORITHMS),
    "scatter": ("scatter_algorithm", SCATTER_ALGORITHMS),
    "all_gather": ("allgather_algorithm", ALLGATHER_ALGORITHMS),
}


# One machine: every rank is on the same "node", so nothing is ever priced on `inter`.
LOCAL_GPUS_PER_NODE = 1024

# Per-call host costs: the sweep's payload at its smallest sizes, where the bytes cost little
# and the fixed part (Python, per-leaf pickling, header encode/decode) dominates.
PER_CALL_PAYLOAD = ("rl_rollout", (1, 2, 3), 512)


@dataclass(frozen=True)
class Sample:
    """Median over iterations of the max over ranks, for one collective shape."""

    kind: str
    group_size: int
    payload_bytes: int
    """nccl-tests S: broadcast bytes; scatter/all_gather total bytes over the group."""
    nbytes: int
    """``Comm.nbytes`` convention (scatter: one chunk)."""
    p50_s: float


@dataclass(frozen=True)
class Fit:
    kind: str
    algorithm: str
    link: LinkConf
    r2: float
    max_rel_err: float
    rms_rel_err: float


def signal_cost(per_rank: list[list[float]]) -> dict[str, float]:
    """Seconds of one signal: per iteration the last rank to hold the message (max over
    ranks), median over iterations, divided by the readers the writer signalled in turn."""
    per_iter = [max(ts) for ts in zip(*per_rank)]
    readers = max(len(per_rank) - 1, 1)
    return {"signal_s": statistics.median(per_iter) / readers} if per_iter else {}


def per_call_costs(per_rank: list[dict], rates: dict[str, float]) -> dict[str, float]:
    """Fixed seconds per call: each timed call minus what ``rates`` charge for its bytes
    (memcpy for the packed message and pickle for its non-tensor blob; unpickle for a received
    blob), median over ranks, sizes and repetitions, clamped at 0."""
    charge = {
        "pack": lambda n, nt: n / rates["memcpy_bytes_per_s"] + nt / rates["pickle_bytes_per_s"],
        "unpack": lambda n, nt: nt / rates["unpickle_bytes_per_s"],
        "pickle": lambda n, nt: n / rates["pickle_bytes_per_s"],
        "unpickle": lambda n, nt: n / rates["unpickle_bytes_per_s"],
    }
    out = {}
    for kind, cost in charge.items():
        fixed = [t - cost(n, nt) for r in per_rank for t, n, nt in r.get(kind, ())]
        out[f"{kind}_call_s"] = max(0.0, statistics.median(fixed)) if fixed else 0.0
    return out


def fit_kind(samples: list[Sample], kind: str, algorithm: str) -> Fit:
    """Least squares of t = a·α + b·β in relative error (every size counts, not just the big
    ones), with α, β ≥ 0."""
    param = ALGORITHMS[kind][0]
    rows = [s for s in samples if s.kind == kind]
    coef = np.array(
        [coefficients(kind, s.group_size, s.nbytes, **{param: algorithm}) for s in rows]
    )
    t = np.array([s.p50_s for s in rows])
    alpha, beta = relative_fit([coef[:, 0], coef[:, 1]], t)
    beta = beta if beta > 0 else 1e-15  # a bandwidth, however large, where bytes cost nothing
    pred = coef @ np.array([alpha, beta])
    rel = (pred - t) / t
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2)) or 1.0
    return Fit(
        kind,
        algorithm,
        LinkConf.from_si(float(alpha), float(beta)),
        r2=1 - ss_res / ss_tot,
        max_rel_err=float(np.max(np.abs(rel))),
        rms_rel_err=float(np.sqrt(np.mean(rel**2))),
    )


def best_fits(samples: list[Sample]) -> dict[str, Fit]:
    """Per collective, the algorithm form whose fit has the lowest RMS relative error."""
    out = {}
    for kind, (_, algorithms) in ALGORITHMS.items():
        fits = [fit_kind(samples, kind, a) for a in algorithms]
        out[kind] = min(fits, key=lambda f: f.rms_rel_err)
    return out


def build_local_cluster(
    fits: dict[str, Fit], host: dict[str, float], world_size: int = 0, cpu_cores: int = 0
) -> ClusterConf:
    """The ``local`` cluster the fits and host rates (SI, as measured) describe."""
    by_kind = {kind: f.link for kind, f in fits.items()}
    memcpy = host["memcpy_bytes_per_s"]
    return ClusterConf(
        name="local",
        gpus_per_node=LOCAL_GPUS_PER_NODE,
        nics_per_node=1,
        intra=by_kind["broadcast"],
        inter=by_kind["broadcast"],  # never used: one machine is one node
        broadcast_algorithm=fits["broadcast"].algorithm,
        scatter_algorithm=fits["scatter"].algorithm,
        allgather_algorithm=fits["all_gather"].algorithm,
        intra_by_kind=by_kind,
        inter_by_kind={},
        d2h_gbytes_per_s=host.get("d2h_bytes_per_s", memcpy) / GB,
        h2d_gbytes_per_s=host.get("h2d_bytes_per_s", memcpy) / GB,
        pickle_gbytes_per_s=host["pickle_bytes_per_s"] / GB,
        unpickle_gbytes_per_s=host["unpickle_bytes_per_s"] / GB,
        memcpy_gbytes_per_s=memcpy / GB,
        device_copy_gbytes_per_s=host.get("device_copy_bytes_per_s", 0.0) / GB,
        **{
            f"{k}_call_us": host.get(f"{k}_call_s", 0.0) / US
            for k in ("pickle", "unpickle", "pack", "unpack")
        },  # fmt: skip
        signal_us=host.get("signal_s", 0.0) / US,
        # A CPU world time-slices the machine's cores; a GPU world does not (factor off).
        cpu_cores=0 if "device_copy_bytes_per_s" in host else cpu_cores,
        calibrated_ranks=world_size,
    )


def write_cluster_yaml(cluster: ClusterConf, path: Path, header: str) -> None:
    """The cluster as YAML under ``header`` (as comments), written atomically: a crash never
    leaves half a file where the harness reads its presets."""
    from omegaconf import OmegaConf

    def rounded(node):  # 4 significant digits: the fit is not better than that
        if isinstance(node, float) and node < 1e-3 and node != 0:
            return float(f"{node:.3e}")
        if isinstance(node, dict):
            return {k: rounded(v) for k, v in node.items()}
        return float(f"{node:.4g}") if isinstance(node, float) else node

    cfg = OmegaConf.to_container(OmegaConf.structured(cluster))
    text = OmegaConf.to_yaml(OmegaConf.create(rounded(cfg)))
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_atomic(path, comment + text)


def format_report(
    fits: dict[str, Fit], samples: list[Sample], host: dict, world_size: int, elapsed_s: float
) -> str:
    lines = [f"fit per collective (world {world_size}, {elapsed_s:.1f} s):"]
    for kind, f in fits.items():
        lines.append(
            f"  {kind:<10} {f.algorithm:<18} alpha {f.link.alpha_s * 1e6:8.1f} us  "
            f"bw {f.link.bandwidth_gbytes_per_s:6.3f} GB/s  R2 {f.r2:.4f}  "
            f"max rel err {100 * f.max_rel_err:5.1f}%  rms {100 * f.rms_rel_err:5.1f}%"
        )
    lines.append("measured p50 vs model (ms):")
    for s in samples:
        f = fits[s.kind]
        param = ALGORITHMS[s.kind][0]
        a, b = coefficients(s.kind, s.group_size, s.nbytes, **{param: f.algorithm})
        pred = a * f.link.alpha_s + b * f.link.beta_s_per_byte
        lines.append(
            f"  {s.kind:<10} p={s.group_size} S={s.payload_bytes:>9} B  "
            f"measured {s.p50_s * 1e3:8.3f}  model {pred * 1e3:8.3f}  "
            f"({100 * (pred - s.p50_s) / s.p50_s:+5.1f}%)"
        )
    lines.append(
        "host: "
        + ", ".join(
            f"{k.replace('_bytes_per_s', '')} {v / 1e9:.3f} GB/s"
            for k, v in host.items()
            if k.endswith("_bytes_per_s")
        )
    )
    calls = {k: v for k, v in host.items() if k.endswith("_call_s")}
    if calls:
        name, sizes, seq_len = PER_CALL_PAYLOAD
        lines.append(
            f"per call ({name} B={list(sizes)} seq {seq_len}, bytes subtracted): "
            + ", ".join(f"{k.removesuffix('_call_s')} {v * 1e6:.0f} us" for k, v in calls.items())
        )
    if "signal_s" in host:
        lines.append(
            f"shared memory: {host['signal_s'] * 1e6:.1f} us per node-local rank signalled "
            f"(writer + {world_size - 1} readers, last reader's p50 over the readers)"
        )
    return "\n".join(lines)
