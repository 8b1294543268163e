"""The α–β cost model's answers, pure: every strategy priced and ranked on a layout
(``predict``) and Ray dispatch priced (``ray_dispatch``). The pricing itself is
``strategies.core.pricing`` (``auto`` uses it); the commands that calibrate, predict,
extrapolate and validate are in ``harness.commands``."""
