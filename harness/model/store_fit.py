"""Fit the pull stores' costs (``strategies.core.cluster.StoreConf``: put/get α, β and fetch
contention) to a pull sweep's records: what each pull strategy measured beyond what the rest
of its plan is priced at is its store's put and contended gets. Pure: the records come from
``bcastbench store-calibrate`` (``harness.commands.store_calibrate``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from strategies.core.cluster import GB, US, ClusterConf, StoreConf, put_share
from strategies.core.plan import Plan
from strategies.core.pricing import price
from strategies.core.store_pricing import readers

STORE_OF = {
    "independent_fetch": "node_shm",
    "ray_object_store": "ray_object",
    "transferqueue": "transferqueue",
    "mooncake": "mooncake",
    "nixl": "nixl",
    "self_load": "page_cache",
}
"""The store each pull strategy fetches from (its plan's ``StoreFetch.store``)."""
CONTENTION_GRID = np.round(np.arange(0.0, 5.001, 0.01), 2)
"""Fetch contentions tried (0 = readers in parallel, 1 = served one at a time, above 1 = a
loaded host slows them further); for each, α and β are a linear least squares."""


@dataclass(frozen=True)
class StoreSample:
    """One pull record, split into what its store costs and what the rest of its plan does."""

    store: str
    nbytes: float
    """The bytes the store's β prices: put once and fetched by each reader
    (``StoreFetch.priced_bytes``: fewer where the readers read some fields)."""
    readers: int
    """Readers of one store at once (``store_pricing.readers``)."""
    rest_s: float
    """The plan priced with its store free (signals, barrier, packing), oversubscription
    factor divided out."""
    measured_s: float
    """The record's p50 (max over ranks, median over calls), the factor divided out."""


@dataclass(frozen=True)
class StoreFit:
    """One store's fitted constants and how well they price the records they came from."""

    store: str
    """The store kind (``STORE_OF``'s values: the node store, Ray's, TransferQueue's)."""
    conf: StoreConf
    """Its fitted α, β and fetch contention."""
    samples: int
    """Records the fit used."""
    median_abs_err: float
    """Median |predicted / measured − 1| of the whole call over the fitted samples."""


def free_stores(cluster: ClusterConf) -> ClusterConf:
    """``cluster`` with every store priced free: what the rest of a pull plan costs."""
    return replace(cluster, stores={kind: StoreConf() for kind in STORE_OF.values()})


def sample_of(plan: Plan, layout, cluster: ClusterConf, p50_s: float) -> StoreSample | None:
    """The record of a pull plan on ``layout`` as a sample; None for a plan without stores (a
    replica of one rank)."""
    if not plan.stores:
        return None
    fetch = plan.stores[0]
    rest = price(plan, free_stores(cluster), layout, check=False)
    factor = rest.oversubscription
    nbytes = fetch.priced_bytes(put_share(fetch.store))
    return StoreSample(
        fetch.store, nbytes, readers(fetch, cluster), rest.total_s / factor, p50_s / factor
    )


def _lstsq(samples: list[StoreSample], contention: float) -> tuple[float, float, float]:
    """(α, β, sum of squared relative errors) for one contention, α and β ≥ 0: least squares
    of measured = rest + w·(α + n·β), w = 1 + contention·(readers − 1), relative to measured."""
    w = np.array([1 + contention * (s.readers - 1) for s in samples])
    t = np.array([s.measured_s for s in samples])
    rest = np.array([s.rest_s for s in samples])
    n = np.array([float(s.nbytes) for s in samples])
    a = np.stack([w / t, w * n / t], axis=1)
    b = 1 - rest / t
    (alpha, beta), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha < 0:  # bandwidth alone
        alpha, beta = 0.0, max(0.0, float(a[:, 1] @ b / (a[:, 1] @ a[:, 1])))
    elif beta < 0:  # latency alone
        alpha, beta = max(0.0, float(a[:, 0] @ b / (a[:, 0] @ a[:, 0]))), 0.0
    residual = a @ np.array([alpha, beta]) - b
    return float(alpha), float(beta), float(residual @ residual)


def fit_store(samples: list[StoreSample]) -> StoreFit:
    """The contention on ``CONTENTION_GRID`` (and its α, β) with the least squared relative
    error of the whole call; one reader count only cannot show contention, so it stays 0."""
    if not samples:
        raise ValueError("fit_store: no samples")
    grid = CONTENTION_GRID if len({s.readers for s in samples}) > 1 else np.array([0.0])
    best = min((_lstsq(samples, c) + (float(c),) for c in grid), key=lambda r: r[2])
    alpha, beta, _, contention = best
    conf = StoreConf(
        call_us=alpha / US,
        gbytes_per_s=1 / (beta * GB) if beta > 0 else 0.0,
        fetch_contention=contention,
    )
    errors = [abs(predict_s(conf, s) / s.measured_s - 1) for s in samples]
    return StoreFit(samples[0].store, conf, len(samples), float(np.median(errors)))


def predict_s(conf: StoreConf, s: StoreSample) -> float:
    """The whole call as the fitted store prices it (factor divided out)."""
    one = conf.call_s + s.nbytes * conf.beta_s_per_byte
    return s.rest_s + one * (1 + conf.fetch_contention * (s.readers - 1))


def fit_all(samples: list[StoreSample]) -> dict[str, StoreFit]:
    """One fit per store the samples hold, in ``STORE_OF``'s order."""
    by_store: dict[str, list[StoreSample]] = {}
    for s in samples:
        by_store.setdefault(s.store, []).append(s)
    return {k: fit_store(by_store[k]) for k in STORE_OF.values() if k in by_store}


def format_fits(fits: dict[str, StoreFit]) -> str:
    """One line per store: its α, rate, contention and how well it fits."""
    lines = ["store fits (the call's p50 = rest of the plan + (α + n/rate)·(1 + c·(readers − 1))):"]
    for kind, f in fits.items():
        c = f.conf
        lines.append(
            f"  {kind:<13} alpha {c.call_us:9.1f} us  rate {c.gbytes_per_s:7.3f} GB/s  "
            f"contention {c.fetch_contention:4.2f}  {f.samples} records  "
            f"median |err| {100 * f.median_abs_err:5.1f}%"
        )
    return "\n".join(lines)
