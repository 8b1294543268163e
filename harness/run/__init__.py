"""Running a job: typed config and its validation (config, sweep), who runs the ranks (launch:
forked, joined or emulated), the job (app), worlds (the protocol; forked: the forked world),
payloads, what every job measures alike (rounds), the rank-side job (runner), verification and
records. The ``bcastbench`` command that runs it is ``harness.commands``."""
