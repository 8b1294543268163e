"""Fit the pull stores' costs (``strategies.core.cluster.StoreConf``: put/get α, β and fetch
contention) to a pull sweep's records: what each pull strategy measured beyond what the rest
of its plan is priced at is its store's put and contended gets. Pure: the records come from
``bcastbench store-calibrate`` (``harness.commands.store_calibrate``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from harness.model.least_squares import nonneg_lstsq
from strategies.core.cluster import GB, NO_PUT_PER_CALL, US, ClusterConf, StoreConf, put_share
from strategies.core.plan import Plan
from strategies.core.pricing import price
from strategies.core.store_pricing import fetch_s, readers

STORE_OF = {
    "independent_fetch": "node_shm",
    "ray_object_store": "ray_object",
    "transferqueue": "transferqueue",
    "mooncake": "mooncake",
    "nixl": "nixl",
    "self_load": "page_cache",
    "torch_shared": "torch_shared",
}
"""The store each pull strategy fetches from (its plan's ``StoreFetch.store``)."""
CONTENTION_GRID = np.round(np.arange(0.0, 5.001, 0.01), 2)
"""Fetch contentions tried (0 = readers in parallel, 1 = served one at a time, above 1 = a
loaded host slows them further); for each, α and β are a linear least squares."""


@dataclass(frozen=True)
class StoreSample:
    """One pull record, split into what its store costs and what the rest of its plan does."""

    store: str
    nbytes: int
    """Bytes put once (``StoreFetch.nbytes``)."""
    readers: int
    """Readers of one store at once (``store_pricing.readers``)."""
    rest_s: float
    """The plan priced with its store free (signals, barrier, packing), oversubscription
    factor divided out."""
    measured_s: float
    """The record's p50 (max over ranks, median over calls), the factor divided out."""
    read_bytes: int | None = None
    """Bytes each reader got, where it read some fields (``StoreFetch.read_bytes``); None: all
    ``nbytes``."""
    calls: int = 1
    """Times the call paid the store's α (``StoreFetch.calls``)."""

    @property
    def got_bytes(self) -> int:
        return self.nbytes if self.read_bytes is None else self.read_bytes


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
    return StoreSample(
        fetch.store,
        fetch.nbytes,
        readers(fetch, cluster),
        rest.total_s / factor,
        p50_s / factor,
        fetch.read_bytes,
        fetch.calls,
    )


def splits(samples: list[StoreSample]) -> bool:
    """Whether the samples can tell a put's bytes from a get's: some reader read fewer bytes
    than were put (lazy fetch), of a store whose calls make a put (``NO_PUT_PER_CALL``)."""
    return any(s.got_bytes != s.nbytes and s.store not in NO_PUT_PER_CALL for s in samples)


def _lstsq(
    samples: list[StoreSample], contention: float, split: bool
) -> tuple[float, float, float, float]:
    """(α, β_put, β_get, sum of squared relative errors) for one contention, all ≥ 0: least
    squares of measured = rest + w·(α·calls + n·β_put + m·β_get), n put and m got, w = 1 +
    contention·(readers − 1), relative to measured. Where the samples cannot tell the two apart
    (``split`` false: ``splits``), they are one β on the bytes got (β_get): every byte put
    where each reader got them all, and only those read where no call makes a put
    (``NO_PUT_PER_CALL``)."""
    w = np.array([1 + contention * (s.readers - 1) for s in samples])
    t = np.array([s.measured_s for s in samples])
    rest = np.array([s.rest_s for s in samples])
    n = np.array([float(s.nbytes) for s in samples])
    m = np.array([float(s.got_bytes) for s in samples])
    calls = np.array([float(s.calls) for s in samples])
    columns = [w * calls / t, w * m / t] + ([w * n / t] if split else [])
    coef, residual = nonneg_lstsq(np.stack(columns, axis=1), 1 - rest / t)
    alpha, beta_get, beta_put = (*coef, 0.0)[:3]
    return float(alpha), float(beta_put), float(beta_get), residual


def fit_store(samples: list[StoreSample]) -> StoreFit:
    """The contention on ``CONTENTION_GRID`` (and its α, β) with the least squared relative
    error of the whole call; one reader count only cannot show contention, so it stays 0."""
    if not samples:
        raise ValueError("fit_store: no samples")
    grid = CONTENTION_GRID if len({s.readers for s in samples}) > 1 else np.array([0.0])
    split = splits(samples)
    best = min((_lstsq(samples, c, split) + (float(c),) for c in grid), key=lambda r: r[3])
    alpha, beta_put, beta_get, _, contention = best
    beta = beta_put + beta_get
    conf = StoreConf(
        call_us=alpha / US,
        gbytes_per_s=1 / (beta * GB) if beta > 0 else 0.0,
        fetch_contention=contention,
        put_share=(
            0.0
            if samples[0].store in NO_PUT_PER_CALL
            else (beta_put / beta if split and beta > 0 else None)
        ),
    )
    errors = [abs(predict_s(conf, s) / s.measured_s - 1) for s in samples]
    return StoreFit(samples[0].store, conf, len(samples), float(np.median(errors)))


def predict_s(conf: StoreConf, s: StoreSample) -> float:
    """The whole call as the fitted store prices it (factor divided out)."""
    share = put_share(s.store, conf)
    priced = share * s.nbytes + (1 - share) * s.got_bytes
    return s.rest_s + fetch_s(conf, priced, s.readers, s.calls)


def fit_all(samples: list[StoreSample]) -> dict[str, StoreFit]:
    """One fit per store the samples hold, in ``STORE_OF``'s order."""
    by_store: dict[str, list[StoreSample]] = {}
    for s in samples:
        by_store.setdefault(s.store, []).append(s)
    return {k: fit_store(by_store[k]) for k in STORE_OF.values() if k in by_store}


def format_fits(fits: dict[str, StoreFit]) -> str:
    """One line per store: its α, rate, contention and how well it fits."""
    lines = [
        "store fits (the call's p50 = rest of the plan + (α·calls + n/rate)·(1 + c·(readers − 1)); "
        "calls: 1, a storage per leaf for torch_shared; n: the put's share of the bytes put, the "
        "rest of the bytes each reader got):"
    ]
    for kind, f in fits.items():
        c = f.conf
        share = "" if c.put_share is None else f"  put share {c.put_share:4.2f}"
        lines.append(
            f"  {kind:<13} alpha {c.call_us:9.1f} us  rate {c.gbytes_per_s:7.3f} GB/s  "
            f"contention {c.fetch_contention:4.2f}{share}  {f.samples} records  "
            f"median |err| {100 * f.median_abs_err:5.1f}%"
        )
    return "\n".join(lines)
