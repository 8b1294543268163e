"""Running a job: the ``bcastbench`` command (cli), typed config and its validation (config,
sweep), who runs the ranks (launch: forked, joined or emulated), the Hydra task (app), worlds,
payloads, the rank-side job (runner), verification, records and sweep progress."""
