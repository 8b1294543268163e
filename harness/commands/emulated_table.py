"""Which strategy wins depends on the cluster's NIC layout: measure it on an emulated cluster.

    bcastbench validate target=emulated                                  # run both jobs
    bcastbench validate target=emulated source=results/reference_emulated  # re-read records

Two jobs run on the emulated 2-node cluster (harness.worlds.emulated; tp=2 inside a node, pp=2 across
1 Gbit/s links, rl_rollout 720 × 512 ≈ 16 MiB): one with one link per node, one with one link
per rank ("rails"). Each job times all seven strategies interleaved (``auto``, told the link
layout's cost model preset, is the job's strategy and the other six its references, so every
strategy sees the same machine noise; its row names the strategy it chose), and
its counting phase gives the bytes one call sent across nodes. Beside each measurement the cost
model's price of the strategy's plan on ``conf/cluster/emulated.yaml`` / ``emulated_rails.yaml``
and the predicted / measured ratio; a strategy is "link-bound" when the model puts more than
half its time on the inter-node link. The markdown table goes to ``<dir>/report.md``.

Configured through ``conf/commands/emulated_table.yaml`` (schema ``EmulatedTableConf``; the
``payload/`` group): ``<dir>`` is ``out``, or the Hydra job's directory
(``results/emulated/<time>``); the table's rows and the command that made them also go to the job's
``emulated_table.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import strategies
from harness import paths
from harness.commands.hydra_app import run_app
from harness.commands.tool import job_command, job_dir
from harness.errors import ConfigError
from harness.files import write_atomic, write_json
from harness.job.config_schema import PayloadConf
from harness.machine import other_cores, snapshot
from harness.model.prices import predicted_cross_bytes
from harness.payload import generated
from harness.worlds.emulated_network import unavailable_reason
from strategies.core.cluster import load_cluster
from strategies.core.layout import Layout
from strategies.core.plan import spec_of
from strategies.core.pricing import price

MODULE = "harness.commands.emulated_table"
"""Where ``bcastbench validate target=emulated`` lives (its printed name:
``harness.errors.program``)."""

STRATEGIES = ("pickled", "header", "flat", "pp_first", "scatter_allgather", "shm", "auto")
"""What each job times; ``auto`` is the job's strategy (it alone takes an option: the cost
model preset of the link layout, so it chooses as a user of that cluster would)."""
AUTO = "auto"
LINKS = {"node": "emulated", "gpu": "emulated_rails"}
"""Emulated link layout → the cost model preset that describes it."""
LINK_TITLES = {"node": "one link per node", "gpu": "one link per GPU (rails)"}
WIRE = 1514 / 1448  # wire bytes per payload byte at MTU 1500 (Ethernet + IP + TCP headers)
TIE = 0.05
"""Measured times closer than this (relative) are a tie: either order counts as agreeing."""
REPO = paths.REPO


def run_jobs(out: Path, iters: int, warmup: int, batch_size: int, seq_len: int,
             payload: str = "rl_rollout") -> None:  # fmt: skip
    """One harness job per link layout, each on its own emulated cluster."""
    for links in LINKS:
        argv = [sys.executable, "-m", "harness", f"strategy={AUTO}", "layout=tp2pp2"]
        argv += [f"+strategy.options.cluster={LINKS[links]}"]
        argv += [f"references=[{','.join(s for s in STRATEGIES if s != AUTO)}]"]
        argv += [f"payload={payload}", f"payload.batch_size={batch_size}"]
        argv += [f"payload.seq_len={seq_len}", f"iters={iters}", f"warmup={warmup}"]
        argv += ["emulate.enabled=true", "emulate.nodes=2", "emulate.rate_mbit=1000"]
        argv += [f"emulate.links={links}", f"hydra.run.dir={out / links}"]
        print(f"cluster table: running {LINK_TITLES[links]} …", flush=True)
        start = snapshot()
        subprocess.run(argv, cwd=REPO, check=True)
        # The intra-node phases are CPU-bound: other work on the machine slows them (never the
        # shaped links), so the report says how much of the machine other work took.
        machine = {"cpus": os.cpu_count(), "other_cores": other_cores(start)}
        write_json(out / links / "machine.json", machine)


def measured(record: dict) -> dict[str, dict]:
    """p50 and cross-node bytes per call of every strategy in one job's record."""
    rows = {
        record["strategy"]: {
            "p50_us": record["p50_us"],
            "cross_node_bytes_per_call": record.get("cross_node_bytes_per_call"),
            "choice": record.get("auto_choice"),
        }
    }
    for name, ref in (record.get("references") or {}).items():
        rows[name] = {
            "p50_us": ref["p50_us"],
            "cross_node_bytes_per_call": ref.get("cross_node_bytes_per_call"),
        }
    return rows


def predictions(batch_size: int, seq_len: int, seed: int = 0,
                payload: str = "rl_rollout") -> dict[str, dict[str, dict]]:  # fmt: skip
    """{links: {strategy: {total_s, link_bound, cross_bytes}}} from each strategy's plan."""
    layout = Layout(tp=2, pp=2)
    spec = spec_of(generated.make(payload, batch_size, seq_len, seed, None))
    out: dict[str, dict[str, dict]] = {}
    for links, preset in LINKS.items():
        cluster = load_cluster(preset)
        out[links] = {}
        for name in STRATEGIES:
            # auto prices its candidates on the preset it is told, as its job is run.
            extra = {"cluster": preset} if name == AUTO else {}
            plan = strategies.get_class(name).plan(layout, spec, **extra)
            pred = price(plan, cluster, layout)
            inter_beta = sum(s.critical.beta_s for s in pred.steps if s.critical.link == "inter")
            out[links][name] = {
                "total_s": pred.total_s,
                "link_bound": inter_beta > 0.5 * pred.total_s,
                "cross_bytes": predicted_cross_bytes(plan, cluster.gpus_per_node),
                "dominant": pred.dominant(),
            }
    return out


def ranking_agrees(meas: dict[str, float], pred: dict[str, float]) -> tuple[bool, list[str]]:
    """Whether every pair that both the measurement and the model separate by more than TIE is
    ordered alike (a tie on either side, e.g. the model's equal prices for header, flat and
    pp_first on rails, cannot disagree)."""

    def tie(t: dict[str, float], a: str, b: str) -> bool:
        return abs(t[a] - t[b]) <= TIE * min(t[a], t[b])

    names = sorted(meas)
    bad = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if tie(meas, a, b) or tie(pred, a, b):
                continue
            if (meas[a] < meas[b]) != (pred[a] < pred[b]):
                bad.append(f"{a} vs {b}")
    return not bad, bad


def load_records(root: Path) -> dict[str, dict]:
    """``{links: record}`` of the two jobs under ``root`` (``node/``, ``gpu/``)."""
    recs = {}
    for links in LINKS:
        path = root / links / "result.json"
        if not path.is_file():
            raise FileNotFoundError(f"no {path}")
        recs[links] = json.loads(path.read_text())
    return recs


def _payload(record: dict) -> str:
    """The payload a job's record ran (its name; records name it so)."""
    name = record.get("payload", "rl_rollout")
    return name if isinstance(name, str) else "rl_rollout"


def compare(root: Path) -> list[dict]:
    """Measured p50 and predicted time of every strategy of both jobs under ``root``."""
    recs = load_records(root)
    first = recs["node"]
    preds = predictions(first["batch_size"], first["seq_len"], payload=_payload(first))
    return [
        dict(
            links=links,
            preset=LINKS[links],
            strategy=name,
            measured_ms=m["p50_us"] / 1e3,
            predicted_ms=preds[links][name]["total_s"] * 1e3,
        )
        for links, rec in recs.items()
        for name, m in measured(rec).items()
        if name in preds[links]
    ]


def _machine_note(root: Path, links: str) -> str:
    """How busy the machine was during the job (``machine.json`` beside the record)."""
    path = root / links / "machine.json"
    m = json.loads(path.read_text()) if path.is_file() else {}
    if m.get("other_cores") is None:
        return ""
    note = f"; other work used {m['other_cores']:.2f} of {m['cpus']} CPUs meanwhile"
    if m["other_cores"] > 0.5:
        note += " (CPU-bound phases ran slow: times are upper bounds)"
    return note


def _section(root: Path, links: str, rec: dict, preds: dict[str, dict]) -> tuple[list, bool, bool]:
    """One link layout's table and verdict lines; (lines, all link-bound within 10 %, agree)."""
    meas = measured(rec)
    s = rec["payload_bytes"]
    lines = [
        f"## {LINK_TITLES[links]} (`emulate.links={links}`, cost model `{LINKS[links]}`)",
        "",
        f"payload S = {s / 2**20:.2f} MiB, {rec['iters']} timed iterations, "
        f"{rec['emulate_rate_mbit']} Mbit/s, {rec['emulate_nodes']} nodes × "
        f"{rec['emulate_ranks_per_node']} ranks{_machine_note(root, links)}",
        "",
        "| strategy | measured p50 ms | predicted ms | predicted/measured | link-bound | "
        "crossed per call (× S) | predicted crossing (× S) | model: dominated by |",
        "|---|---:|---:|---:|:-:|---:|---:|---|",
    ]
    ratios_bound = []
    names = [n for n in STRATEGIES if n in meas]  # records from before auto lack it
    for name in sorted(names, key=lambda n: meas[n]["p50_us"]):
        m, p = meas[name], preds[name]
        ms = m["p50_us"] / 1e3
        ratio = p["total_s"] * 1e3 / ms
        if p["link_bound"]:
            ratios_bound.append((name, ratio))
        crossed = m["cross_node_bytes_per_call"]
        crossed_txt = f"{crossed / s:.3f}" if crossed is not None else "–"
        label = f"{name} → {m['choice']}" if m.get("choice") else name
        lines.append(
            f"| {label} | {ms:.1f} | {p['total_s'] * 1e3:.1f} | {ratio:.3f} | "
            f"{'yes' if p['link_bound'] else 'no'} | {crossed_txt} | "
            f"{p['cross_bytes'] * WIRE / s:.3f} | {p['dominant']} |"
        )
    agree, bad = ranking_agrees(
        {n: meas[n]["p50_us"] for n in names}, {n: preds[n]["total_s"] for n in names}
    )
    within = [n for n, r in ratios_bound if abs(r - 1) <= 0.10]
    lines += [
        "",
        f"- link-bound strategies within 10 %: {len(within)} of {len(ratios_bound)} "
        f"({', '.join(f'{n} {r:.3f}' for n, r in ratios_bound)})",
        f"- ranking (pairs within {TIE:.0%} in either column are ties): "
        + ("same as measured" if agree else f"differs on {', '.join(bad)}"),
        "",
    ]
    return lines, len(within) == len(ratios_bound), agree


def table(root: Path) -> str:
    recs = load_records(root)
    first = recs["node"]
    preds = predictions(first["batch_size"], first["seq_len"], payload=_payload(first))
    lines = [
        "# Emulated 2-node cluster: 1 Gbit/s links, tp=2 in a node, pp=2 across",
        "",
        "Measured: `bcastbench validate target=emulated` (harness.worlds.emulated, gloo on CPU,",
        "p50 of the slowest rank per iteration, every strategy interleaved in one job per",
        "link layout). Predicted: each strategy's plan priced by strategies.core.pricing on",
        "conf/cluster/emulated.yaml (one link per node) and emulated_rails.yaml (one per rank).",
        "Bytes are wire bytes per call that crossed nodes (S = payload; predicted = plan's",
        f"payload bytes × {WIRE:.4f}).",
        "",
    ]
    verdicts = []
    for links, rec in recs.items():
        section, ok, agree = _section(root, links, rec, preds[links])
        lines += section
        verdicts.append(
            f"{LINK_TITLES[links]}: {'all link-bound within 10 %' if ok else 'NOT all within 10 %'}"
            f", {'same ranking' if agree else 'ranking differs'}"
        )
    lines.append("Verdict: " + "; ".join(verdicts))
    return "\n".join(lines) + "\n"


@dataclass
class EmulatedTableConf:
    """Root config of ``conf/commands/emulated_table.yaml``."""

    payload: PayloadConf = field(default_factory=PayloadConf)
    """Both jobs' batch (a generated payload); reuses ``conf/payload/``."""
    iters: int = 7
    """Timed rounds of each job (every strategy once per round, interleaved)."""
    warmup: int = 1
    """Untimed rounds first."""
    source: str | None = None
    """Re-read the records of an earlier table's directory (``node/``, ``gpu/``) and write its
    report.md again; nothing runs. null: run both jobs (needs root)."""
    out: str | None = None
    """Where the two jobs and report.md go; null: the Hydra job's directory."""


def check(cfg) -> None:
    """The values a table reads, checked before any job runs (``command.run_app``)."""
    if cfg.payload.name not in generated.PAYLOADS:
        raise ConfigError(
            f"payload.name: {cfg.payload.name!r} is not generated; valid: {sorted(generated.PAYLOADS)}"
        )
    p = cfg.payload
    for key, value, least in (("iters", cfg.iters, 1), ("warmup", cfg.warmup, 0),
                              ("payload.batch_size", p.batch_size, 1),
                              ("payload.seq_len", p.seq_len, 1)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{key} must be >= {least}, got {value}")
    if cfg.source is not None:
        try:
            first = load_records(Path(cfg.source))["node"]
            first["batch_size"], first["seq_len"]  # noqa: B018 - what the table reads first
        except (FileNotFoundError, KeyError, ValueError) as exc:
            raise ConfigError(
                f"source={cfg.source}: not a cluster table directory ({exc})"
            ) from None
        return
    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(f"the emulated cluster cannot be built here: {reason}")


def task(cfg) -> str:
    """One Hydra job: both jobs (or ``source``'s records), the table, its report.md."""
    root = Path(cfg.source or cfg.out or job_dir())
    if cfg.source is None:
        p = cfg.payload
        run_jobs(root, cfg.iters, cfg.warmup, p.batch_size, p.seq_len, p.name)
    text = table(root)
    write_atomic(root / "report.md", text)
    command = job_command(MODULE)
    record = {
        "kind": "emulated_table",
        "root": str(root),
        "rows": compare(root),
        "command": command,
    }
    write_json(job_dir() / "emulated_table.json", record)
    print(text)
    print(f"report: {root / 'report.md'}")
    return text


def main(argv: list[str] | None = None) -> int:
    """``bcastbench validate target=emulated [overrides]``; a bad value exits 2 with one line."""
    return run_app(MODULE, "emulated_table", task, check, argv, schema=EmulatedTableConf)


if __name__ == "__main__":
    sys.exit(main())
