"""Running a job: typed config and its validation (config, sweep), who runs the ranks (launch:
forked, joined or emulated), the job (app), worlds, payloads, the rank-side job (runner),
verification and records. The ``bcastbench`` command that runs it is ``harness.commands``."""
