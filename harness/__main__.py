"""``python -m harness``: the ``bcastbench`` command (``harness.commands.cli``); with no subcommand it
runs one job, or a Hydra sweep with ``-m``."""

from __future__ import annotations

import sys

from harness.commands.cli import main as cli


def main() -> None:

    sys.exit(cli())


if __name__ == "__main__":
    main()
