"""Import megatron-core's ``parallel_state`` without running ``megatron/core/__init__.py``.

That ``__init__`` pulls in the optimizer, FSDP and transformer stacks (seconds of CPU per
process), none of which a broadcast benchmark uses; every rank that torchrun, Slurm or
the emulated cluster spawns would pay it. The package is registered without executing its
``__init__`` only when nothing imported it yet, so a process that already uses Megatron (a
user's training job) gets the real package; any failure falls back to the normal import.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
import warnings


class _DropFxTracingNotice(logging.Filter):
    """torch's multi-line notice that ``is_fx_tracing`` covers torch.export too, which every
    rank prints the first time a jagged (nested) tensor is touched: it addresses people who
    trace models, not a broadcast."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


def quiet_megatron() -> None:
    """Megatron's import-time UserWarnings and INFO lines, and torch's fx-tracing notice, say
    nothing about a broadcast: the one place that silences them, called before megatron-core
    is imported (every rank does, through ``parallel_state``)."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron.*")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    fx = logging.getLogger("torch.fx._symbolic_trace")
    if not any(isinstance(f, _DropFxTracingNotice) for f in fx.filters):
        fx.addFilter(_DropFxTracingNotice())


def parallel_state():
    """megatron-core's ``parallel_state`` module, imported without the package ``__init__``."""
    quiet_megatron()
    if "megatron.core" not in sys.modules:
        try:
            spec = importlib.util.find_spec("megatron.core")
            if spec is not None and spec.submodule_search_locations:
                package = types.ModuleType("megatron.core")
                package.__path__ = list(spec.submodule_search_locations)
                package.__spec__ = spec
                package.__file__ = spec.origin
                package.__package__ = "megatron.core"
                sys.modules["megatron.core"] = package
                sys.modules["megatron"].core = package
        except Exception:
            sys.modules.pop("megatron.core", None)
    try:
        return importlib.import_module("megatron.core.parallel_state")
    except Exception:
        # A megatron-core whose parallel_state needs its package __init__: import it fully.
        for name in [n for n in sys.modules if n.startswith("megatron.core")]:
            del sys.modules[name]
        return importlib.import_module("megatron.core.parallel_state")
