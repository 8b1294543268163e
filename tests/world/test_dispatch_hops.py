"""The edge_stages and chain dispatch modes' hops (harness.job.dispatch_hops) on the session's
4-rank gloo world, without Ray: every rank that must hold the chunk ends with the source's bytes,
the middle stages with nothing, and each rank issues exactly the collectives ``hop_plan`` lists
for it (counted, on the groups the plan names).
"""

from __future__ import annotations

import pytest
import torch

from harness.job.dispatch import flat_bytes
from harness.job.dispatch_hops import object_hops, raw_hops
from harness.job.verification import digest, tensor_digest
from harness.model.dispatch_ranks import holding_ranks, hop_plan, ray_ranks
from harness.payload import generated
from strategies.core.layout import Layout
from strategies.core.plan import spec_of
from strategies.core.trace import Recorder

pytestmark = pytest.mark.world


def _batch():
    return generated.make("rl_rollout", 2, 32, seed=5, broadcast_non_tensor=True)


def hops_job(ctx, kind: str, layout: Layout, raw: bool) -> dict:
    """One call of ``kind``'s hops, the chunk given to the ranks Ray would hand it to."""
    groups = ctx.groups_for(layout)
    source = any(ctx.rank in rep for rep in ray_ranks(kind, layout))
    batch = _batch()
    with Recorder() as rec:
        if raw:
            flat = torch.from_numpy(flat_bytes(batch))
            held = raw_hops(kind, groups, flat.clone() if source else torch.empty_like(flat))
        else:
            held = object_hops(kind, groups, batch if source else None)
    if held is None:
        fingerprint = None
    else:
        fingerprint = tensor_digest(held) if raw else digest(held, True)
    comms = [(c.kind, c.ranks, c.nbytes) for c in rec.comms]
    return {"rank": ctx.rank, "held": fingerprint, "comms": comms, "unavailable": rec.unavailable}


@pytest.mark.parametrize("raw", [False, True], ids=["pickled", "raw"])
@pytest.mark.parametrize("kind", ["edge_stages", "chain"])
@pytest.mark.parametrize("layout", [Layout(pp=2, tp=2), Layout(pp=4)], ids=["tp2pp2", "pp4"])
def test_hops_deliver_to_the_holders_with_the_planned_collectives(world4, kind, layout, raw):
    batch = _batch()
    expected = tensor_digest(torch.from_numpy(flat_bytes(batch))) if raw else digest(batch, True)
    plan = hop_plan(kind, layout, spec_of(batch), raw)
    holders = holding_ranks(kind, layout)
    for out in world4.run(hops_job, kind, layout, raw):
        rank = out["rank"]
        assert out["held"] == (expected if rank in holders else None), rank
        assert out["unavailable"] is None
        planned = plan.for_rank(rank)
        assert len(out["comms"]) == len(planned), (rank, out["comms"], planned)
        for (what, ranks, nbytes), comm in zip(out["comms"], planned):
            # A send or recv is recorded on its PP group; the plan names the pair it joins.
            assert set(comm.ranks) <= set(ranks), (rank, ranks, comm)
            across = len({layout.coords(r)["pp"] for r in comm.ranks}) > 1
            assert what == (("send" if rank == comm.root else "recv") if across else "broadcast")
            if raw or comm.what == "sizes":
                assert nbytes == comm.nbytes, (rank, nbytes, comm)
