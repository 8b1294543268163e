"""Ray worlds and driver-to-rank dispatch: ranks as Ray actors in a placement group, and the
dispatch modes RL frameworks use (``leader`` + a broadcast strategy, or ``all_ranks``) timed from
"the driver holds the global batch" to "every rank holds its chunk".

``world`` starts the actors and their torch.distributed world; ``dispatch`` times the modes;
``emulated`` runs the same on one Ray node per emulated cluster node. Needs ``ray`` (optional).
"""
