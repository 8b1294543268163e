"""Price a plan's store fetches (``plan.StoreFetch``: the pull strategies' put once, every other
rank gets): a put and a get at the store's α and β, fetch contention as more ranks read one
store at once, and the bytes that cross to other nodes.

``strategies.core.host_work`` adds the result to the receiver's work. Pure: no process group,
no torch.
"""

from __future__ import annotations

from strategies.core.cluster import ClusterConf, StoreConf, put_share
from strategies.core.groups import node_split
from strategies.core.plan import Plan, StoreFetch


def fetch_s(store: StoreConf, nbytes: float, readers: int, calls: int = 1) -> float:
    """Seconds until the last of ``readers`` concurrent readers of one store holds its copy: a
    put and one get take α·calls + n·β (n: ``StoreFetch.priced_bytes``; calls:
    ``StoreFetch.calls``), each further reader adds ``fetch_contention`` of that."""
    if readers <= 0:
        return 0.0
    one = store.call_s * calls + nbytes * store.beta_s_per_byte
    return one * (1.0 + store.fetch_contention * (readers - 1))


def readers(fetch: StoreFetch, cluster: ClusterConf) -> int:
    """The most readers one store serves at once: per node (a node store, or Ray's copy of the
    object on each node), or every reader of the replica (one store for all)."""
    nodes = node_split(fetch.ranks, cluster.node_of)
    if fetch.scope == "replica":
        return len(fetch.ranks) - 1
    # The writer's node: every rank but the writer; another node: all its ranks read its copy.
    return max([len(nodes[0]) - 1, *(len(node) for node in nodes[1:])])


def crossing_s(fetch: StoreFetch, cluster: ClusterConf) -> float:
    """Seconds the fetch's bytes spend crossing nodes (0 on one node, or where the plan's
    ``Handoff`` carries them): a node-scoped store copies the object once to each other node,
    a replica-scoped one sends it once to each remote reader. The flows leave the writer's
    node at once and share its ports, priced on the inter-node broadcast link."""
    nodes = node_split(fetch.ranks, cluster.node_of)
    if not fetch.crosses or len(nodes) == 1:
        return 0.0
    remote = nodes[1:]
    flows = len(remote) if fetch.scope == "node" else sum(len(node) for node in remote)
    # A node store's copy is the whole object; a remote reader of one store gets its fields.
    nbytes = fetch.nbytes if fetch.scope == "node" else fetch.got_bytes
    link = cluster.link("broadcast", crosses_nodes=True)
    share = max(1.0, flows / cluster.nics_per_node)
    return link.alpha_s + nbytes * link.beta_s_per_byte * share


def store_s(plan: Plan, cluster: ClusterConf) -> float:
    """The plan's store fetches on the critical path: the replicas fetch at once (each from its
    own object), so the slowest replica's crossing and contended fetch."""
    worst = 0.0
    for fetch in plan.stores:
        store = cluster.store(fetch.store)
        nbytes = fetch.priced_bytes(put_share(fetch.store, store))
        fetched = fetch_s(store, nbytes, readers(fetch, cluster), fetch.calls)
        seconds = crossing_s(fetch, cluster) + fetched
        worst = max(worst, seconds)
    return worst
