"""``bcastbench``: one command, a verb per question a user asks; ``target=NAME`` picks what the
verb works on when it can answer for more than one thing.

    bcastbench run [target=job|dispatch|dispatch-emulated] [Hydra overrides]
    bcastbench bench [target=cpu|gpu] [--quick]      a named bench sweep, then its report
    bcastbench compare OLD NEW                       two runs cell by cell
    bcastbench report [target=md|csv] DIR            what a run or sweep directory holds
    bcastbench predict [target=layout|scale|ray] [overrides]    the cost model's price
    bcastbench calibrate [target=cluster|store|ray] [overrides | DIR]   fit it to this machine
    bcastbench validate [target=sweep|ray|emulated] [DIR | overrides]   check it against records
    bcastbench schema FILE -o schema.yaml            a recorded batch's shape

A verb's first target is its default (``bcastbench calibrate`` is ``calibrate target=cluster``);
``target=NAME`` may stand anywhere among the arguments and is taken out before the rest go to
the target's module. Every ``[overrides]`` target is a Hydra app configured by
``conf/commands/<module>.yaml`` (``run target=dispatch``: ``conf/commands/ray_dispatch.yaml``),
sweeps with ``-m`` and shows its config with ``--cfg job``; ``run``'s own job is
``conf/config.yaml``.

The commands' old names (``ALIASES``: ``ray-dispatch``, ``collect``, ...) stay for one release:
each prints its new spelling as one line on stderr, then does exactly what it did.

Arguments that do not start with a verb (or an old name) go to ``run``, so ``bcastbench
strategy=flat`` and ``python -m harness strategy=flat`` are the same job. Every target's module
exposes ``main(argv) -> int``; this file only dispatches, by module name, so that
``bcastbench --help`` imports none of them (nor torch).

A bad config, name or value prints one line naming the field and what is valid and exits 2
(no traceback); a failed job exits 1 with its error; Ctrl-C prints where the records written so
far are and exits 130 (``harness.commands.run``).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from dataclasses import dataclass

from harness.errors import USAGE_EXIT

TARGET = "target="
"""How a target is named on the command line: ``target=NAME``."""


@dataclass(frozen=True)
class Target:
    """One thing a verb can do: the module that does it, in words, and what it always passes."""

    module: str
    """The module whose ``main(argv)`` runs it."""
    what: str
    """One line for ``bcastbench --help``."""
    fixed: tuple[str, ...] = ()
    """Arguments put before the user's (``validate target=ray`` is the Ray model's
    ``task=validate``)."""


@dataclass(frozen=True)
class Verb:
    """A question a user asks, and the targets that answer it; the first is the default."""

    what: str
    targets: dict[str, Target]

    @property
    def default(self) -> str:
        return next(iter(self.targets))


VERBS = {
    "run": Verb(
        "one job, or a sweep with -m (Hydra overrides; `run --help` shows the config)",
        {
            "job": Target(
                "harness.commands.run",
                "a strategy on any world: forked, torchrun, Ray, emulated",
            ),
            "dispatch": Target(
                "harness.commands.ray_dispatch",
                "Ray dispatch modes side by side on a Ray world",
            ),
            "dispatch-emulated": Target(
                "harness.commands.ray_emulated",
                "Ray dispatch modes across emulated Ray nodes (root)",
            ),
        },
    ),
    "bench": Verb(
        "a named bench sweep on this machine, then its report",
        {
            "cpu": Target(
                "harness.commands.bench",
                "conf/sweep/bench.yaml on gloo CPU (--quick: bench_quick.yaml)",
            ),
            "gpu": Target("harness.commands.gpu_check", "the CUDA sweeps on a single-GPU machine"),
        },
    ),
    "compare": Verb(
        "OLD NEW: two runs cell by cell, new/old with a 95 % interval and a verdict",
        {"runs": Target("harness.commands.compare", "result directories, results.csv or JSON")},
    ),
    "report": Verb(
        "DIR: what a run or sweep directory holds",
        {
            "md": Target("harness.commands.report", "report.md and figures beside the records"),
            "csv": Target("harness.report.collect", "one CSV row per job (results.csv)"),
        },
    ),
    "predict": Verb(
        "the cost model's price; nothing runs",
        {
            "layout": Target(
                "harness.commands.predict", "every strategy's time on one layout and cluster"
            ),
            "scale": Target("harness.commands.extrapolate", "every strategy from 8 to 16,384 GPUs"),
            "ray": Target("harness.commands.ray_model", "Ray dispatch modes at 16,384 GPUs"),
        },
    ),
    "calibrate": Verb(
        "fit the cost model to this machine",
        {
            "cluster": Target(
                "harness.commands.calibrate", "α, β and host costs (conf/cluster/local.yaml)"
            ),
            "store": Target(
                "harness.commands.store_calibrate",
                "DIR: the pull stores' put/get costs, from a pull sweep",
            ),
            "ray": Target(
                "harness.commands.ray_calibrate", "Ray's put/get/call costs (conf/ray/local.yaml)"
            ),
        },
    ),
    "validate": Verb(
        "the cost model against measurements",
        {
            "sweep": Target("harness.commands.validate", "DIR: every record of a measured sweep"),
            "ray": Target(
                "harness.commands.ray_model",
                "records=[FILE,...]: measured Ray dispatch records",
                fixed=("task=validate",),
            ),
            "emulated": Target(
                "harness.commands.emulated_table",
                "both emulated link layouts, measured (root) or source=DIR",
            ),
        },
    ),
    "schema": Verb(
        "FILE -o schema.yaml: a recorded batch's shape, no data",
        {"file": Target("harness.payload.schema_command", "a recorded batch read safely")},
    ),
}


@dataclass(frozen=True)
class Alias:
    """An old command name: the verb and target that now do what it did, for one release."""

    verb: str
    target: str
    note: str = ""
    """More of the new spelling, where the old command answered two questions."""

    def spelling(self) -> str:
        return " ".join(["bcastbench", self.verb, f"{TARGET}{self.target}"])


ALIASES = {
    "extrapolate": Alias("predict", "scale"),
    "store-calibrate": Alias("calibrate", "store"),
    "collect": Alias("report", "csv"),
    "emulated-table": Alias("validate", "emulated"),
    "ray-dispatch": Alias("run", "dispatch"),
    "ray-emulated": Alias("run", "dispatch-emulated"),
    "ray-calibrate": Alias("calibrate", "ray"),
    "ray-model": Alias("predict", "ray", note=" (task=validate: `bcastbench validate target=ray`)"),
    "gpu-check": Alias("bench", "gpu"),
}
"""Every command name of the last release that is no verb now; they go in the next one."""


def usage() -> str:
    """The verbs (two spaces in), each with its targets (four), and the old names."""
    width = max(map(len, VERBS))
    lines = []
    for name, verb in VERBS.items():
        lines.append(f"  {name:<{width}}  {verb.what}")
        if len(verb.targets) > 1:
            shown = [f"{TARGET}{t}" for t in verb.targets]
            shown_width = max(map(len, shown))
            for label, target in zip(shown, verb.targets.values()):
                lines.append(f"    {label:<{shown_width}}  {target.what}")
    return (
        "usage: bcastbench <verb> [target=NAME] [args...]   (no verb: run)\n\n"
        "verbs, each with its targets (the first is the default):\n" + "\n".join(lines) + "\n\n"
        "`bcastbench <verb> [target=NAME] --help` for each.\n"
        + textwrap.fill(
            f"Old names work this release, each printing its new spelling: {', '.join(ALIASES)}.",
            width=96,
        )
    )


class TargetError(ValueError):
    """A ``target=`` the verb does not have (or two of them); the message is the one line."""


@dataclass(frozen=True)
class Call:
    """A command line parsed: which verb's target runs, on what; ``alias``: the old name it
    was called by, if any."""

    verb: str
    target: str
    args: tuple[str, ...]
    """The user's arguments, ``target=`` taken out."""
    alias: str | None = None

    @property
    def module(self) -> str:
        return VERBS[self.verb].targets[self.target].module

    @property
    def default(self) -> bool:
        return self.target == VERBS[self.verb].default

    @property
    def prog(self) -> str:
        """The name it prints: an old name its own, a non-default target with its verb
        (``bcastbench validate target=ray``)."""
        if self.alias:
            return f"bcastbench {self.alias}"
        return f"bcastbench {self.verb}" + ("" if self.default else f" {TARGET}{self.target}")

    @property
    def argv(self) -> list[str]:
        """What the module's ``main`` gets: the target's fixed arguments first, except under
        an old name, which does exactly what it did."""
        fixed = () if self.alias else VERBS[self.verb].targets[self.target].fixed
        return [*fixed, *self.args]


def parse(argv: list[str]) -> Call:
    """The ``Call`` of a command line (no verb: ``run``); ``TargetError`` for a target that is
    not the verb's. A verb with one target takes no ``target=``: its arguments are its own."""
    if argv and argv[0] in ALIASES:
        alias = ALIASES[argv[0]]
        return Call(alias.verb, alias.target, tuple(argv[1:]), alias=argv[0])
    verb, rest = (argv[0], argv[1:]) if argv and argv[0] in VERBS else ("run", argv)
    targets = VERBS[verb].targets
    given = [i for i, a in enumerate(rest) if a.startswith(TARGET)]
    if not given or len(targets) == 1:
        return Call(verb, VERBS[verb].default, tuple(rest))
    name = rest[given[0]].removeprefix(TARGET)
    if len(given) > 1 or name not in targets:
        wrong = "target= given twice" if len(given) > 1 else rest[given[0]]
        raise TargetError(f"{wrong}: one of {', '.join(targets)} (default {VERBS[verb].default})")
    return Call(verb, name, tuple(rest[: given[0]] + rest[given[0] + 1 :]))


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default: the command line) to a verb's target; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    try:
        call = parse(argv)
    except TargetError as exc:
        verb = argv[0] if argv and argv[0] in VERBS else "run"
        print(f"bcastbench {verb}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    if call.alias:
        print(
            f"{call.prog}: now `{ALIASES[call.alias].spelling()}`{ALIASES[call.alias].note}; "
            "this alias goes in the next release",
            file=sys.stderr,
        )
    elif call.default and len(VERBS[call.verb].targets) > 1 and {"-h", "--help"} & {*call.args}:
        # The help that follows is the default target's: say so, and that there are others.
        print(
            f"{call.prog}: targets {', '.join(VERBS[call.verb].targets)} (this help: "
            f"{call.target}); `{call.prog} target=NAME --help` for another"
        )
    # Hydra apps read sys.argv, and the commands name themselves from it; a caller that
    # dispatches in process (a test, a notebook) gets its own argv back afterwards.
    saved = sys.argv
    try:
        if call.module != VERBS["run"].targets["job"].module:  # the job app sets its own
            sys.argv = [call.prog, *call.argv]
        status = importlib.import_module(call.module).main(call.argv)
        # A command that hands back what it made (records, a fit) has succeeded.
        return status if isinstance(status, int) else 0
    finally:
        sys.argv = saved
