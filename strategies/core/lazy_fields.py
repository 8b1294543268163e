"""ROLL's lazy fetch (``RemoteBatch``: a stage fetches only the fields it reads) as the
``fields`` option of the pull strategies: which leaves a reader reads, what the harness checks
it got (``Strategy.delivers``), and the leader's check that the batch holds every field asked
for. Shared by the engine stores (``strategies.core.engine_store``), ``independent_fetch``,
``ray_object_store`` and ``transferqueue``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tensordict import TensorDict

from strategies.core.contract import FAILURE_KEY, ContractError, leaves
from strategies.core.header_format import Header
from strategies.core.strategy_base import Strategy


@dataclass(frozen=True, kw_only=True)
class FieldsOptions(Strategy.Options):
    fields: tuple[str, ...] | list[str] = ()
    """ROLL's lazy fetch (``RemoteBatch``): the fields a stage reads, by name (a nested leaf as
    ``outer.inner``; a name covers every leaf under it). Readers read only those leaves (and
    the non-tensor batch, when the call carries one) and get a batch of those fields; the
    leader keeps its whole batch. Empty: every field. A field the batch lacks fails the call
    on every rank."""

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [f for f in self.fields if not isinstance(f, str) or not f.strip(".")]
        if isinstance(self.fields, str) or bad:
            raise ValueError(
                f"fields must be a list of field names (e.g. [input_ids, log_probs]), got "
                f"{self.fields!r}"
            )


def covers(field: str, name: str) -> bool:
    """Whether a ``fields`` entry names the leaf ``name`` (dotted), or a container above it."""
    return name == field or name.startswith(field + ".")


class LazyFields:
    """A strategy whose readers read ``options.fields`` only (its ``Options`` derive from
    ``FieldsOptions``)."""

    def wanted(self, key: tuple[str, ...]) -> bool:
        """Whether a leaf (its key path) is among ``fields``: named, or under a named one. A
        failure batch's one leaf is always read: it is the leader's error."""
        if key == (FAILURE_KEY,):
            return True
        name = ".".join(key)
        return any(covers(f, name) for f in self.options.fields)

    def delivers(self, key: tuple[str, ...]) -> bool:
        return not self.options.fields or self.wanted(key)

    def keep_wanted(self, td):
        """A reader's TensorDict of the leaves it reads (``td`` itself, without ``fields``)."""
        if not self.options.fields or td is None:
            return td
        out = TensorDict({}, batch_size=td.batch_size)
        for key, value in leaves(td):
            if self.wanted(key):
                out.set(key, value)
        return out

    def check_fields(self, batch) -> None:
        """Leader: every field the readers ask for is in the batch."""
        if not self.options.fields or batch.batch is None:
            return
        names = [".".join(k) for k, _ in leaves(batch.batch)]
        missing = [f for f in self.options.fields if not any(covers(f, n) for n in names)]
        if missing:
            raise ContractError(
                f"rank {self.groups.rank}: {self.name}: the readers ask for fields {missing}, "
                f"which the batch lacks; its fields: {names}"
            )

    def field_ranges(self, header: Header) -> tuple[Header, list[tuple[int, int]]]:
        """A reader of some fields, the message's ``header`` read: the header of the leaves it
        wants, and the byte ranges of the message to read, (offset, bytes): those leaves' and
        the non-tensor blob's."""
        entries = tuple(e for e in header.entries if self.wanted(e.key))
        ranges = [(header.header_len + e.offset, e.nbytes) for e in entries if e.nbytes]
        if header.non_tensor is not None:
            ranges.append((header.header_len + header.non_tensor[0], header.non_tensor[1]))
        return replace(header, entries=entries), ranges


def fields_bytes(spec, fields, header: bool = False) -> int | None:
    """The bytes a reader of ``fields`` gets of a batch of ``spec`` (``plan.PayloadSpec``):
    its named leaves', the non-tensor batch's where it travels, and with ``header`` the
    message's header a reader of the packed message reads first; None without ``fields``
    (it reads everything). ``fields`` as a label gives them (``predict``'s
    ``ray_object_store[fields=input_ids+log_probs]``) is one string joined by ``+``."""
    names = tuple(fields.split("+")) if isinstance(fields, str) else tuple(fields)
    if not names:
        return None
    if spec.leaf_names is None or spec.leaf_bytes is None:
        raise ValueError(
            f"pricing fields {list(names)} needs the batch's leaf names and bytes "
            "(PayloadSpec.leaf_names, leaf_bytes; spec_of gives both)"
        )
    missing = [f for f in names if not any(covers(f, n) for n in spec.leaf_names)]
    if missing:
        raise ValueError(
            f"fields {missing} are not in the batch; its fields: {list(spec.leaf_names)}"
        )
    picked = sum(
        n for key, n in zip(spec.leaf_names, spec.leaf_bytes) if any(covers(f, key) for f in names)
    )
    return picked + spec.sent_non_tensor_bytes + (spec.header_bytes if header else 0)
