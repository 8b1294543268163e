"""Test infrastructure that stands in for more than one machine: a real single-node Slurm and
network-namespace nodes. Used by tests only; each piece skips itself where it cannot run."""
