"""One job, from its validated config to its record: the typed spec, the measured phases and
their rounds, the broadcast job (on every rank) and the dispatch job (from a Ray driver) side
by side, verification, and the record. ``harness.job.execute.run_job`` is the one way a job
runs; the worlds it runs on are ``harness.worlds``, its batches ``harness.payload``."""
