"""Property tests of the recorded-batch and schema loaders, tier 1: random bytes, random YAML,
mutated real recordings (memmap directories' meta.json and leaf files, torch.save zips cut or
flipped, verl pickles cut) and pickles that would run code. Whatever the input, the loader
either returns a batch within the byte limit or raises one line of its own error; it never
raises anything else, never changes a file, never runs the pickle, and answers quickly. A few
examples go through the whole `bcastbench run` to check the exit status and stderr. No process
group.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from hostile_support import (
    CLI_S,
    QUICK_S,
    memmap_recording,
    run_cli,
    snapshot,
    torch_recording,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from verl_support import verl_dataproto

from harness.paths import CONF_DIR
from harness.payload import payload_schema, recording, schema_replay, user_files

LIMIT = 1 << 20
"""The byte limit every example runs under: a missing check would show as a batch above it."""
ERRORS = (user_files.PayloadFileError, payload_schema.SchemaError)

EXAMPLES = settings(
    max_examples=100,
    deadline=None,  # a loaded 2-core machine; each example checks its own time instead
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def outcome(call, watched: list[Path], marker: Path | None = None):
    """``call()``'s batch, or its one-line error; nothing watched changed, nothing ran."""
    before = snapshot(*watched)
    start = time.monotonic()
    try:
        result, error = call(), None
    except ERRORS as exc:
        result, error = None, str(exc)
    took = time.monotonic() - start
    assert snapshot(*watched) == before, "an input changed"
    assert took < QUICK_S, took
    assert marker is None or not marker.exists(), "code from the input ran"
    if error is not None:
        assert "\n" not in error and error.startswith("payload.path: "), error
        event(_gist(error))
    else:
        event("loaded")
        assert recording.batch_bytes(result) <= LIMIT
    return result, error


def _gist(error: str) -> str:
    """An error's kind, for hypothesis' statistics: its words without paths and numbers."""
    words = [w for w in error.split()[2:] if "/" not in w and not any(c.isdigit() for c in w)]
    return " ".join(words[:6])


def load_file(path: Path, batch_size: int = 8):
    return recording.load(path, max_bytes=LIMIT, batch_size=batch_size)


def make_schema(path: Path, batch_size: int = 8):
    schema_replay.check(str(path), batch_size, LIMIT)
    return schema_replay.make(str(path), batch_size, 0, max_bytes=LIMIT)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A fresh directory per example (hypothesis reuses function-scoped fixtures)."""
    root = tmp_path_factory.mktemp("hostile")
    count = iter(range(10**9))

    def fresh() -> Path:
        path = root / f"ex{next(count)}"
        path.mkdir()
        return path

    return fresh


# -- random bytes and random YAML --------------------------------------------------------------
HEADS = [
    b"", b"PK\x03\x04", b"\x80\x02", b"\x80\x04\x95", b"format: bcastbench.schema/1\n",
    b"# bcastbench batch schema\n", b"\xef\xbb\xbf",
]  # fmt: skip


@EXAMPLES
@given(head=st.sampled_from(HEADS), body=st.binary(max_size=2048))
def test_random_bytes(scratch, head, body):
    path = scratch() / "f"
    path.write_bytes(head + body)
    outcome(lambda: load_file(path), [path.parent])
    outcome(lambda: make_schema(path), [path.parent])


VOCAB = [
    "format", "batch_size", "batch_dims", "leaves", "non_tensor_batch", "meta_info", "key",
    "kind", "dtype", "shape", "trailing_shape", "lengths", "percentiles", "items", "value",
    "type", "tensor", "jagged", "non_tensor_stack", "non_tensor_data", "int64", "bfloat16",
    "bool", "cuda", "Tensor", "object", "<U4", "str", "int", payload_schema.FORMAT, "../x",
]  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.sampled_from(VOCAB),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.dictionaries(st.sampled_from(VOCAB) | st.text(max_size=5), kids, max_size=5)
    ),
    max_leaves=20,
)
SEEDS = [
    yaml.safe_load((CONF_DIR / "schemas" / f"{name}.yaml").read_text())
    for name in ("rl_rollout", "multimodal")
] + [
    {
        "format": payload_schema.FORMAT, "batch_size": 2, "batch_dims": [],
        "leaves": [
            {"key": ["ids"], "kind": "jagged", "dtype": "int64", "trailing_shape": [2],
             "lengths": {"percentiles": [1.0] * 11}},
            {"key": ["n", "t"], "kind": "non_tensor_stack", "items": "str",
             "lengths": {"percentiles": [3.0] * 11}},
            {"key": ["flag"], "kind": "non_tensor_data", "items": "bool", "value": True},
        ],
        "non_tensor_batch": {}, "meta_info": {"step": {"type": "int", "value": 3}},
    }
]  # fmt: skip


def mutate(doc, data, value_strategy):
    """``doc`` with one node (found by a random walk) replaced by a drawn value, or removed."""
    parent, key, node = None, None, doc
    for _ in range(data.draw(st.integers(0, 5), label="depth")):
        if isinstance(node, dict) and node:
            parent, key = node, data.draw(st.sampled_from(sorted(node, key=str)), label="key")
        elif isinstance(node, list) and node:
            parent, key = node, data.draw(st.integers(0, len(node) - 1), label="index")
        else:
            break
        node = parent[key]
    if parent is None:
        return doc
    if data.draw(st.booleans(), label="remove") and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = data.draw(value_strategy, label="value")
    return doc


@EXAMPLES
@given(data=st.data(), batch_size=st.integers(1, 64))
def test_random_and_mutated_yaml(scratch, data, batch_size):
    path = scratch() / "s.yaml"
    form = data.draw(st.sampled_from(["random", "mutated", "text"]), label="form")
    if form == "random":
        text = yaml.safe_dump(data.draw(values, label="doc"))
    elif form == "mutated":
        doc = json.loads(json.dumps(data.draw(st.sampled_from(SEEDS), label="seed")))
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            doc = mutate(doc, data, values)
        text = yaml.safe_dump(doc, sort_keys=False)
    else:
        text = data.draw(st.text(alphabet="[]{}:-?&*!|>#'\", \nak19.", max_size=400), label="text")
    path.write_text(text)
    outcome(lambda: make_schema(path, batch_size), [path.parent])


# -- mutated recordings ------------------------------------------------------------------------
class _Originals(dict):
    """The valid recordings, shown by name in a failing example (not as their bytes)."""

    def __repr__(self) -> str:
        return f"originals({', '.join(self)})"


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """A valid recording in each format, to copy and break."""
    root = tmp_path_factory.mktemp("originals")
    found = _Originals(
        {
            "memmap": memmap_recording(root / "memmap"),
            "torch": torch_recording(root / "rec.pt").read_bytes(),
        }
    )
    try:  # verl's save_to_disk: a pickle holding torch.save bytes
        verl_dataproto(3, 0, True).save_to_disk(root / "verl.pkl")
        found["verl"] = (root / "verl.pkl").read_bytes()
    except pytest.skip.Exception:
        pass  # verl is not installed: the other formats are cut instead
    return found


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.sampled_from([10**12, -1, 0])
    | st.text(max_size=8) | st.sampled_from(VOCAB + ["TensorDict", "NonTensorData", "torch.int64"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)  # fmt: skip


def _json_of(path: Path):
    try:
        return json.loads(path.read_bytes())
    except ValueError:
        return None


def _break_memmap(rec: Path, outside: Path, data) -> None:
    files = _files(rec)
    target = data.draw(st.sampled_from(files), label="file")
    how = data.draw(
        st.sampled_from(
            ["meta", "meta", "truncate", "extend", "garbage", "delete", "fifo", "link"]
        ),
        label="how",
    )
    metas = [f for f in files if f.name == "meta.json" and _json_of(f) is not None]
    if how == "meta" and metas:  # (an earlier break may have left none that parses)
        meta_file = data.draw(st.sampled_from(metas), label="meta.json")
        meta_file.write_text(json.dumps(mutate(_json_of(meta_file), data, json_values)))
    elif how == "truncate":
        target.write_bytes(target.read_bytes()[: data.draw(st.integers(0, target.stat().st_size))])
    elif how == "extend":
        target.write_bytes(target.read_bytes() + data.draw(st.binary(min_size=1, max_size=64)))
    elif how == "garbage":
        target.write_bytes(data.draw(st.binary(max_size=256), label="garbage"))
    elif how == "delete":
        target.unlink()
    elif how == "fifo":
        target.unlink()
        os.mkfifo(target)
    else:
        secret = outside / "secret"
        secret.write_bytes(bytes(target.stat().st_size))
        target.unlink()
        target.symlink_to(secret)


@EXAMPLES
@given(data=st.data(), batch_size=st.integers(1, 64))
def test_mutated_memmap_directory(scratch, originals, data, batch_size):
    here = scratch()
    rec, outside = here / "rec", here / "outside"
    shutil.copytree(originals["memmap"], rec)
    outside.mkdir()
    for _ in range(data.draw(st.integers(1, 3), label="breaks")):
        _break_memmap(rec, outside, data)
    outcome(lambda: load_file(rec, batch_size), [rec, outside])


@EXAMPLES
@given(data=st.data())
def test_cut_or_flipped_torch_save_or_verl_pickle(scratch, originals, data):
    kind = data.draw(st.sampled_from([k for k in ("torch", "verl") if k in originals]))
    whole = originals[kind]
    path = scratch() / "rec"
    if data.draw(st.booleans(), label="cut"):
        path.write_bytes(whole[: data.draw(st.integers(0, len(whole) - 1), label="at")])
    else:
        flipped = bytearray(whole)
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            flipped[data.draw(st.integers(0, len(whole) - 1))] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(flipped))
    outcome(lambda: load_file(path), [path.parent])


# -- pickles that would run code ---------------------------------------------------------------
TARGETS = [
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
    ("builtins", "open"), ("io", "open"), ("subprocess", "check_call"), ("shutil", "rmtree"),
    ("importlib", "import_module"), ("evil_pkg.sub", "Boom"),
]  # fmt: skip


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def hostile_pickle(module: str, name: str, marker: Path, protocol: int) -> bytes:
    """``{"batch": module.name(*args)}`` as raw opcodes, with arguments that create ``marker``
    (or remove the directory it sits in) if the call runs."""
    args = {
        "system": [f"touch {marker}"], "eval": [f"open({str(marker)!r}, 'w')"],
        "exec": [f"open({str(marker)!r}, 'w')"], "open": [str(marker), "w"],
        "check_call": [f"touch {marker}"], "rmtree": [str(marker.parent)],
    }.get(name, [str(marker)])  # fmt: skip
    if protocol >= 4:
        call = _unicode(module) + _unicode(name) + b"\x93"  # STACK_GLOBAL
    else:
        call = b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL
    call += b"(" + b"".join(_unicode(a) for a in args) + b"tR"  # MARK args TUPLE REDUCE
    return bytes([0x80, protocol]) + b"}" + _unicode("batch") + call + b"s."


def _as_torch_save(pickled: bytes, original: bytes) -> bytes:
    """A torch.save zip whose pickle is ``pickled``."""
    source, out = zipfile.ZipFile(io.BytesIO(original)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for entry in source.infolist():
            mine = entry.filename.endswith("data.pkl")
            z.writestr(entry.filename, pickled if mine else source.read(entry))
    return out.getvalue()


@settings(EXAMPLES, max_examples=80)
@given(
    target=st.sampled_from(TARGETS),
    protocol=st.sampled_from([2, 3, 4, 5]),
    container=st.sampled_from(["pickle", "torch.save", "memmap leaf", "memmap stack"]),
)
def test_pickles_that_would_run_code_are_refused_by_name(
    scratch, originals, target, protocol, container
):
    here = scratch()
    marker, (module, name) = here / "marker", target
    pickled = hostile_pickle(module, name, marker, protocol)
    if container == "pickle":
        path = here / "evil.pkl"
        path.write_bytes(pickled)
    elif container == "torch.save":
        path = here / "evil.pt"
        path.write_bytes(_as_torch_save(pickled, originals["torch"]))
    else:
        path = shutil.copytree(originals["memmap"], here / "rec")
        leaf = "note" if container == "memmap leaf" else "texts"
        meta = json.loads((path / leaf / "meta.json").read_text())
        if leaf == "note":
            del meta["data"]
            (path / leaf / "other.pickle").write_bytes(pickled)
        else:
            meta["data"] = "pickle.pkl"
            (path / leaf / "pickle.pkl").write_bytes(pickled)
        (path / leaf / "meta.json").write_text(json.dumps(meta))
    _, error = outcome(lambda: load_file(path), [here], marker)
    assert error is not None and "payload.trust=true" in error, error
    if not (container == "torch.save" and protocol >= 4):  # torch's reader stops at the opcode
        assert f"needs {module}.{name}" in error, error
    assert marker.parent.exists()


# -- through the whole command -------------------------------------------------------------------
@settings(EXAMPLES, max_examples=3)
@given(body=st.binary(max_size=512), as_schema=st.booleans())
def test_random_bytes_through_bcastbench_run(scratch, capsys, monkeypatch, body, as_schema):
    """A NUL is no pickle opcode, no zip and no UTF-8 YAML start: always refused."""
    here = scratch()
    path = here / "f"
    path.write_bytes(b"\x00" + body)
    before = snapshot(path)
    payload = "schema" if as_schema else "file"
    argv = [f"payload={payload}", f"payload.path={path}", f"hydra.run.dir={here / 'hydra'}"]
    status, err, took = run_cli(argv, capsys, monkeypatch)
    assert status == 2 and len(err) == 1 and err[0].startswith("bcastbench: error: "), err
    assert took < CLI_S and snapshot(path) == before


@settings(EXAMPLES, max_examples=3)
@given(data=st.data())
def test_mutated_schema_through_bcastbench_run(scratch, capsys, monkeypatch, data):
    """A drawn value put where a dtype goes, always outside the closed list."""
    here = scratch()
    doc = json.loads(json.dumps(SEEDS[0]))
    doc["leaves"][0]["dtype"] = data.draw(
        st.text(max_size=6).filter(lambda t: t not in user_files.DTYPES)
    )
    path = here / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    argv = ["payload=schema", f"payload.path={path}", f"hydra.run.dir={here / 'hydra'}"]
    status, err, took = run_cli(argv, capsys, monkeypatch)
    assert status == 2 and len(err) == 1 and "unknown dtype" in err[0], err
    assert took < CLI_S
