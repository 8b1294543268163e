"""Running a job: typed config and its validation, forked or joined worlds, the rank-side job,
payloads, verification, records and sweep progress."""
