"""Ray worlds and driver-to-rank dispatch: ranks as Ray actors in a placement group, and the
dispatch modes RL frameworks use (``leader`` + a broadcast strategy, or ``all_ranks``) timed from
"the driver holds the global batch" to "every rank holds its chunk".

``actors`` starts the actors and their torch.distributed world; ``dispatch`` times the modes
(``modes`` names them). ``bcastbench ray-dispatch``, ``ray-emulated`` (one Ray node per emulated
cluster node) and ``ray-calibrate`` are in ``harness.commands``. Needs ``ray`` (optional).
"""
