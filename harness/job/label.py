"""The name a job times a strategy under, parsed in one place: ``<strategy>[:<method>]``
(``header``, ``floor``, ``floor:chunks2``, ``floor:shm``, a calibration probe
``probe:broadcast:4:1048576``). Records, dict keys and configs keep the plain text; code that
asks what a label is (a floor method? a probe?) asks ``Label.parse(text)``.
"""

from __future__ import annotations

from dataclasses import dataclass

SEP = ":"
FLOOR = "floor"
"""The floor: ``floor`` is one raw broadcast, ``floor:<method>`` its other raw methods."""
PROBE = "probe"
"""A calibration probe (``harness.job.probes``): ``probe:<kind>:<ranks>:<bytes>``."""


@dataclass(frozen=True)
class Label:
    """A strategy label: the registered ``strategy`` and, after the first ``:``, its ``method``
    (None where the label has no ``:``; a probe's method is ``<kind>:<ranks>:<bytes>``)."""

    strategy: str
    method: str | None = None

    @classmethod
    def parse(cls, text: str) -> Label:
        """The label ``text`` names: ``floor:shm`` -> Label("floor", "shm")."""
        strategy, sep, method = text.partition(SEP)
        return cls(strategy, method if sep else None)

    @classmethod
    def of(cls, strategy: str, *method_parts: object) -> Label:
        """The label of ``strategy`` with a method of these parts (``method_parts``' inverse):
        ``Label.of("probe", "broadcast", 4, 1048576)``."""
        return cls(strategy, SEP.join(map(str, method_parts)) if method_parts else None)

    def __str__(self) -> str:
        return self.strategy if self.method is None else f"{self.strategy}{SEP}{self.method}"

    def method_parts(self) -> tuple[str, ...]:
        """The method's own ``:``-separated parts (a probe's kind, ranks and bytes); () for
        none."""
        return () if self.method is None else tuple(self.method.split(SEP))

    @property
    def is_floor(self) -> bool:
        """One of the floor's raw methods (``floor``, ``floor:<method>``)."""
        return self.strategy == FLOOR

    @property
    def is_probe(self) -> bool:
        """A calibration probe's raw collective."""
        return self.strategy == PROBE

    @property
    def competes(self) -> bool:
        """Whether it competes to be the fastest strategy: one a user could pick, not a
        yardstick (a floor method) nor a calibration probe."""
        return not (self.is_floor or self.is_probe)
