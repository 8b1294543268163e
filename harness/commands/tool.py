"""What the Hydra-configured tools (``bcastbench run target=dispatch``,
``target=dispatch-emulated``, ``calibrate target=ray``, ``predict|validate target=ray``,
``validate target=emulated``) share inside a job: where it writes, and
the command line that runs that job again.

They run through ``harness.commands.hydra_app.run_app``, as the cost model's commands do: every job
of a ``-m`` sweep is checked before the first starts, a bad value is one line and exit 2.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from harness.errors import program
from harness.files import write_json


def job_dir() -> Path:
    """The running Hydra job's output directory (a run's folder, or a sweep job's subfolder)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def job_command(module: str) -> str:
    """This job's command line as one would type it again: the program as it was called
    (``harness.errors.program``) and the job's own overrides, a sweep's values filled in, each
    quoted for the shell. Hydra's own settings (``hydra.*``) are left out."""
    from hydra.core.hydra_config import HydraConfig

    return " ".join([program(module), *map(shlex.quote, HydraConfig.get().overrides.task)])


def override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override grammar, strings quoted (a value may hold ``:``,
    ``,`` or spaces), for a tool that starts another as a subprocess."""

    def literal(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list | tuple):
            return "[" + ",".join(literal(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{literal(x)}" for k, x in v.items()) + "}"
        return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"

    return f"{key}={literal(value)}"


def write_out(done: list[dict], out: str | None) -> None:
    """Every record this process's jobs made (``done``) as one JSON list in ``out``, when set,
    atomically (``harness.files``): what ``bcastbench validate target=ray`` reads. Each
    job's own record is its ``result.json`` (``harness.job.execute.run_job``)."""
    if out:
        write_json(out, done)
