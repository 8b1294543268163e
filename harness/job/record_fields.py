"""What a record holds: ``Record`` declares every field once, with its type and what it holds
(``FIELDS``: the names and docs, listed in docs/records.md); ``complete`` gives a record every
one of them, null where it does not apply, in that order; ``type_problems`` checks one."""

from __future__ import annotations

from typing import Annotated, TypedDict, get_args, get_origin, get_type_hints


class Record(TypedDict, total=False):
    """One job's record: every field in order, each with its type and what it holds
    (``FIELDS`` is the names and docs, ``type_problems`` checks a record against the types;
    null where a field does not apply)."""

    # what the job was
    strategy: Annotated[
        str | None,
        "the strategy under test (a name, or a class's import path); null for a dispatch mode "
        "that runs none (all_ranks, edge_stages, chain)",
    ]
    options: Annotated[dict, "its keyword options"]
    scope: Annotated[str, "what the clock covers: broadcast | dispatch+broadcast"]
    dispatch: Annotated[
        str | None,
        "Ray dispatch: leader | all_ranks | edge_stages | chain; null for a broadcast job",
    ]
    mode: Annotated[
        str | None,
        "a dispatch job's mode (leader:<strategy>, all_ranks, edge_stages, chain); null for a "
        "broadcast job",
    ]
    world: Annotated[
        str, "who ran the ranks: forked | ray (a joined or emulated world records forked)"
    ]
    backend: Annotated[str, "gloo | nccl"]
    device: Annotated[str, "cpu | cuda"]
    world_size: Annotated[int, "ranks in the world"]
    layout: Annotated[
        str, "the shape that ran (tp2pp2dp2; @<order> when not megatron-core's default)"
    ]
    dp: Annotated[int, "data-parallel size"]
    pp: Annotated[int, "pipeline-parallel size"]
    tp: Annotated[int, "tensor-parallel size"]
    cp: Annotated[int, "context-parallel size"]
    order: Annotated[str, "megatron-core's rank order (tp-cp-ep-dp-pp)"]
    payload: Annotated[str, "the payload generator; payload:<stem> for a recorded file or schema"]
    payload_path: Annotated[
        str | None, "the recorded file or schema read; null for a generated payload"
    ]
    batch_size: Annotated[
        int,
        "rows on each replica leader (a varying workload: the most one leader holds "
        "in one call; each shape's are in shapes)",
    ]
    seq_len: Annotated[
        int | None,
        "tokens per row: the configured one for a generated payload, the recording's "
        "widest second dimension for a recorded one (null when it has none; a varying workload: "
        "its longest)",
    ]
    workload: Annotated[
        str | None,
        "a varying workload's name: cycle:b768/b3, cycle_file:<stem>, draws:<n>, "
        "dp_split:<rows>|drawn (space-separated); null when every call moves the same shape",
    ]
    dp_split: Annotated[
        list | str | None,
        "the replicas' row counts when they differ: a list (one per replica) or drawn; "
        "null when even",
    ]
    iters: Annotated[int, "timed rounds per block"]
    repeats: Annotated[int | None, "blocks of iters timed rounds, one after another"]
    warmup: Annotated[int, "untimed rounds before them"]
    # the outcome
    status: Annotated[str, "ok | unsupported | failed"]
    supported: Annotated[
        bool | None, "whether the strategy accepted the layout and batch (null when failed)"
    ]
    correct: Annotated[
        bool | None, "every rank's batch checked bit for bit (null when not run to the end)"
    ]
    error: Annotated[str | None, "why it was refused or failed, one line; null when ok"]
    error_detail: Annotated[str | None, "the whole message of a failure; null otherwise"]
    # what was measured (null unless ok)
    payload_bytes: Annotated[
        int | None,
        "bytes the floor sends: tensor bytes plus encoded non_tensor_batch (a "
        "dispatch job: its largest replica chunk's)",
    ]
    p50_us: Annotated[float | None, "median per-call latency (max over ranks), microseconds"]
    p50_lo_us: Annotated[
        float | None,
        "the p50's 95 % interval, low end (order statistics, widened to every block's median; "
        "null below 6 calls), microseconds",
    ]
    p50_hi_us: Annotated[float | None, "its high end, microseconds"]
    p90_us: Annotated[float | None, "90th percentile, microseconds"]
    p99_us: Annotated[float | None, "99th percentile, microseconds"]
    min_us: Annotated[float | None, "fastest call, microseconds"]
    max_us: Annotated[float | None, "slowest call, microseconds"]
    mean_us: Annotated[float | None, "mean call, microseconds"]
    rank_skew_us: Annotated[
        float | None,
        "median over calls of the spread of one call's time across ranks, "
        "microseconds (null for a dispatch job, timed on the driver)",
    ]
    algbw_gbps: Annotated[float | None, "payload_bytes / p50 / 1e9 (nccl-tests)"]
    busbw_gbps: Annotated[float | None, "algbw_gbps × 1 for a broadcast (nccl-tests)"]
    floor_p50_us: Annotated[float | None, "the fastest raw method timed in the job, microseconds"]
    floor_method: Annotated[
        str | None,
        "which raw method that was: one | chunks2 | chunks4 | seed_hops | pp_first | shm "
        "(node-local shared memory, CPU jobs); "
        "a dispatch job's floor mode: leader:floor | all_ranks:raw | edge_stages:raw | chain:raw",
    ]
    floor_single_p50_us: Annotated[float | None, "one raw broadcast over the replica, microseconds"]
    floor_network_p50_us: Annotated[
        float | None,
        "the fastest raw method through the collective library (every "
        "method but shm), microseconds",
    ]
    baseline_p50_us: Annotated[
        float | None,
        "pickled (the seed's baseline; a dispatch job: leader:pickled, when timed) "
        "in the same job, microseconds",
    ]
    vs_floor: Annotated[float | None, "p50 / floor_p50_us (lower is better; 1 is the floor)"]
    vs_floor_single: Annotated[float | None, "p50 / floor_single_p50_us"]
    vs_floor_network: Annotated[
        float | None, "p50 / floor_network_p50_us (what a strategy on gloo or NCCL is held to)"
    ]
    vs_baseline: Annotated[
        float | None, "p50 / baseline_p50_us (lower is better; 1/vs_baseline is the speedup)"
    ]
    vs_floor_lo: Annotated[
        float | None,
        "vs_floor's 95 % interval, low end: the median of the per-round ratios to the floor's "
        "call of the same round, order statistics, widened to every block's (null below 6 "
        "rounds)",
    ]
    vs_floor_hi: Annotated[float | None, "its high end"]
    vs_floor_network_lo: Annotated[float | None, "vs_floor_network's interval, low end"]
    vs_floor_network_hi: Annotated[float | None, "its high end"]
    vs_baseline_lo: Annotated[float | None, "vs_baseline's interval, low end"]
    vs_baseline_hi: Annotated[float | None, "its high end"]
    cpu_us_per_call: Annotated[
        float | None,
        "CPU microseconds one call costs the replica: every rank's process CPU inside the "
        "timed call, summed (median over calls; null for a dispatch job, timed on the driver)",
    ]
    cpu_us_leader: Annotated[float | None, "the replica leader's alone, microseconds"]
    leader_plan_us: Annotated[
        float | None,
        "the leader's wall time per call in its own Python: checks, plan lookup, header, "
        "bookkeeping (median over calls, microseconds; the header family and shm, else null)",
    ]
    leader_encode_us: Annotated[
        float | None,
        "the leader's wall time per call pickling the non-tensor batch (the floor has none)",
    ]
    leader_copy_us: Annotated[
        float | None, "the leader's wall time per call copying the leaves and the blob"
    ]
    leader_signal_us: Annotated[
        float | None,
        "the leader's wall time per call handing the message over (signal, send, collective)",
    ]
    leader_clock_us: Annotated[
        float | None,
        "the phase clock's own wall time per call (its reads, calibrated per process), which "
        "the four phases above leave out: an untimed call does not pay it",
    ]
    leader_plan_cpu_us: Annotated[float | None, "leader_plan_us in the leader thread's CPU"]
    leader_encode_cpu_us: Annotated[float | None, "leader_encode_us in the leader thread's CPU"]
    leader_copy_cpu_us: Annotated[float | None, "leader_copy_us in the leader thread's CPU"]
    leader_signal_cpu_us: Annotated[
        float | None,
        "leader_signal_us in the leader thread's CPU (a collective library's own threads are "
        "not in it)",
    ]
    leader_clock_cpu_us: Annotated[float | None, "leader_clock_us in the leader thread's CPU"]
    auto_choice: Annotated[
        str | None, "the strategy auto served the job with; null for any other strategy"
    ]
    auto_tied_with: Annotated[
        list | None,
        "the strategies timed in the same job that auto's choice is not told apart from (the "
        "interval of their ratio to it holds 1): a tie, not a win; null when auto chose none "
        "of the strategies timed",
    ]
    collectives_per_call: Annotated[int | None, "collectives one call makes on its busiest rank"]
    collectives_leader: Annotated[int | None, "collectives the replica leader makes per call"]
    collectives_unavailable: Annotated[
        str | None, "why the collectives could not be counted; null when counted"
    ]
    comm_bytes_leader: Annotated[int | None, "bytes the leader hands to collectives per call"]
    packed_bytes_leader: Annotated[int | None, "bytes the leader packs per call"]
    pickled_bytes_leader: Annotated[int | None, "bytes the leader pickles per call"]
    copied_bytes_leader: Annotated[int | None, "bytes the leader copies per call"]
    pickled_bytes_receiver: Annotated[int | None, "bytes the busiest receiver unpickles per call"]
    copied_bytes_receiver: Annotated[int | None, "bytes the busiest receiver copies per call"]
    peak_rss_bytes: Annotated[int | None, "highest resident set over ranks during one call"]
    peak_rss_delta_bytes: Annotated[int | None, "what that call added to the resident set"]
    peak_rss_heap_released: Annotated[
        bool | None,
        "whether every rank handed its free heap back to the kernel "
        "before that call, so the growth counts every page it allocated (null: not measured)",
    ]
    peak_cuda_bytes: Annotated[
        int | None, "torch.cuda.max_memory_allocated over ranks (null on CPU)"
    ]
    rank_peak_bytes: Annotated[
        int | None,
        "the highest resident set (VmHWM, shared pages counted whole) of a rank over the "
        "strategy's calls from nothing (the node memory phase)",
    ]
    node_peak_bytes: Annotated[
        int | None,
        "the busiest node's peak: the sum of its ranks' peak proportional sets (PSS, a shared "
        "page split among its mappers, so a segment counts once), sampled every "
        "memory_sample_ms during the strategy's calls, with every other strategy dropped",
    ]
    node_idle_bytes: Annotated[
        int | None, "that node's PSS just before: the batch held, no strategy built"
    ]
    node_kept_bytes: Annotated[
        int | None,
        "what the strategy still holds on that node once its calls returned and their "
        "results were dropped (buffers, segments kept for the next call): the part that "
        "adds up when a job interleaves several strategies",
    ]
    node_shm_bytes: Annotated[int | None, "the shared-memory part of node_peak_bytes"]
    node_copies: Annotated[
        float | None,
        "copies of the batch resident on that node at the peak: the leaders' own batches "
        "plus (node_peak_bytes - node_idle_bytes) / payload_bytes",
    ]
    harness_copies: Annotated[
        float | None,
        "the harness's own footprint on that node, in batches: (node_idle_bytes - its PSS "
        "before any batch existed) / payload_bytes",
    ]
    node_ranks: Annotated[int | None, "ranks on that node"]
    memory_sample_ms: Annotated[
        float | None, "milliseconds between two PSS samples: a shorter peak can be missed"
    ]
    cross_node_bytes_per_call: Annotated[
        float | None, "emulated cluster: bytes the node links carried per call"
    ]
    modes: Annotated[
        dict | None, "dispatch: every mode timed in the job, with its p50 and raw floor"
    ]
    unsupported: Annotated[
        dict | None,
        "the references (a dispatch job: the modes) whose strategy refused the layout or "
        "batch, with why; they were left out of the job",
    ]
    references: Annotated[
        dict | None, "every other strategy timed in the same job, with its own figures"
    ]
    shapes: Annotated[
        list | None,
        "a varying workload: one entry per distinct shape, in the order the calls first "
        "move it (batch_size, seq_len, dp_rows, draw, calls, payload_bytes, p50_us, floor_p50_us, "
        "floor_method, vs_floor, baseline_p50_us, vs_baseline, steady_p50_us, vs_steady, "
        "references); the top-level p50_us and payload_bytes are then the whole sequence's per "
        "call; null for a constant workload",
    ]
    world_start_s: Annotated[float | None, "seconds the world took to start (outside every timing)"]
    # the emulated cluster's shape (null elsewhere)
    emulate_nodes: Annotated[int | None, "emulated nodes"]
    emulate_links: Annotated[
        str | None, "node (one shaped link per node) | gpu (one per rank, rails)"
    ]
    emulate_rate_mbit: Annotated[float | None, "each link's rate, Mbit/s"]
    emulate_ranks_per_node: Annotated[int | None, "ranks on each emulated node"]
    emulate_bytes_calls: Annotated[int | None, "calls the link counters were read over"]
    emulate_job_bytes: Annotated[int | None, "bytes all links carried during the job"]
    emulate_link_bytes: Annotated[dict | None, "the same per link"]
    emulate_retransmitted_segments: Annotated[
        int | None,
        "TCP segments the nodes resent during the job (their bytes are in emulate_job_bytes too)",
    ]
    emulate_wall_s: Annotated[
        float | None, "seconds the emulated job took, cluster set-up included"
    ]
    # where and how it ran
    torch_version: Annotated[str, "torch"]
    megatron_core_version: Annotated[str, "megatron-core"]
    tensordict_version: Annotated[str, "tensordict"]
    hostname: Annotated[str, "the machine that wrote the record"]
    cpu_count: Annotated[int | None, "its CPUs"]
    host_cores: Annotated[
        int | None,
        "the whole CPUs this job's process could run on (affinity, capped by its cgroup's CPU quota)",
    ]
    ranks_on_node: Annotated[int | None, "the most ranks of the world on one node"]
    oversubscribed: Annotated[
        bool | None,
        "more ranks on a node than cores: the scheduler, not the strategy, decides much of "
        "the spread (compare ratios inside one job only)",
    ]
    load_avg_1m: Annotated[float | None, "the host's load average over the minute before the job"]
    samples_file: Annotated[
        str | None,
        "every timed call's seconds, per rank and the max over ranks, beside result.json "
        "(harness.job.samples; null when none was written)",
    ]
    git_rev: Annotated[str, "the checkout's commit (-dirty with uncommitted changes)"]
    timestamp: Annotated[str, "when the record was written, UTC"]
    command: Annotated[str, "the command line that made it"]


FIELDS: dict[str, str] = {
    name: get_args(hint)[1] for name, hint in get_type_hints(Record, include_extras=True).items()
}
"""Every field of a record, in order, with what it holds (the README lists the same names)."""


def type_problems(record: dict) -> list[str]:
    """Every field of ``record`` whose value is not of its ``Record`` type, one line each
    (an int is a float's value too, as JSON has it; a bool is no int). Empty: it conforms."""
    problems = []
    for name, hint in get_type_hints(Record).items():
        if name not in record:
            continue
        value = record[name]
        allowed = tuple(get_origin(t) or t for t in (get_args(hint) or (hint,)))
        if float in allowed:
            allowed += (int,)
        if isinstance(value, bool) and bool not in allowed:
            ok = False
        else:
            ok = isinstance(value, allowed)
        if not ok:
            problems.append(f"{name}: {value!r} is {type(value).__name__}, not {hint}")
    return problems


def complete(record: dict) -> Record:
    """``record`` with every field of ``FIELDS`` (null where absent), in their order; a field
    outside the list is kept after them."""
    return {**{k: record.get(k) for k in FIELDS}, **record}
