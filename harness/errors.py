"""How every bcastbench command reports a user's mistake: one line, the program's name, exit 2.

Shared by the job app's CLI (``harness.commands.cli``) and the cost model's Hydra apps
(``harness.commands.hydra_app``), so a bad value reads the same whichever command took it.
"""

from __future__ import annotations

import sys
from pathlib import Path


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any rank starts."""


class VerificationError(AssertionError):
    """A rank ended with data that differs from its leader's; the message names rank and key."""


USAGE_EXIT = 2
"""Exit status for a bad command line or config value (argparse's)."""


def program(module: str) -> str:
    """The name to print for this command: ``bcastbench <sub>`` when the ``bcastbench`` CLI
    dispatched here (it sets ``sys.argv[0]`` so), else ``python -m <module>``, the form that
    runs a module directly (whose ``sys.argv[0]`` is only a file path)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if Path(argv0.split(" ")[0]).name == "bcastbench" else f"python -m {module}"


def one_line(exc: BaseException) -> str:
    """An error as one line: Hydra's 'could not find' lists the valid options; OmegaConf's
    multi-line errors keep their key."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException) and exc.options:
        head = str(exc).strip().splitlines()[0]
        return f"{head}; valid: {', '.join(sorted(exc.options))}"
    cause = exc.__cause__ or exc.__context__
    text = str(exc).strip() or type(exc).__name__
    key = getattr(exc, "full_key", None) or getattr(cause, "full_key", None)
    first = text.splitlines()[0].strip()
    if key and key not in first:
        first = f"{key}: {first}"
    if cause is not None and str(cause).strip() and "full_key" not in first:
        inner = str(cause).strip().splitlines()[0]
        if inner not in first:
            first = f"{first} ({inner})"
    return " ".join(first.split())


def usage_error(prog: str, exc: BaseException, hint: str = "") -> int:
    """Print ``<prog>: error: <one line><hint>`` to stderr; the exit status to leave with."""
    print(f"{prog}: error: {one_line(exc)}{hint}", file=sys.stderr)
    return USAGE_EXIT
