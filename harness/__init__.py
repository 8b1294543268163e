"""bcastbench harness: worlds, payloads, timing, verification, records, sweeps and reports."""
