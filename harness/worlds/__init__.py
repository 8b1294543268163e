"""Worlds of ranks: the protocol every world fills and the registry of live ones (``protocol``),
the rank context they share (``rank``), which world the environment asks for (``launcher``),
and the worlds themselves: forked, joined (torchrun, srun, submitit), Ray actors and the
emulated multi-node cluster. A world starts ranks and runs a callable on them; it knows
nothing of jobs."""
