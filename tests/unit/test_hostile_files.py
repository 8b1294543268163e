"""Hostile recordings and schemas, tier 1: every way a file can lie that the issues list (code in
a pickle, shapes bigger than the file, missing or escaping leaves, special files, YAML too deep,
lengths and shapes past the byte limit) stops `bcastbench run` at validation with one line and
exit 2, in well under a second, with no input changed and no code run. Trust lifts only the
pickle refusal. No process group: a run that passed validation would fail the test instead of
starting ranks.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from hostile_support import (
    CLI_S,
    QUICK_S,
    RunsCode,
    RunsShell,
    Tag,
    evil_memmap,
    memmap_recording,
    one_line_error,
    run_cli,
    snapshot,
    tagged_memmap,
    torch_recording,
)
from omegaconf import OmegaConf
from tensordict import TensorDict

from harness.paths import CONF_DIR
from harness.payload import payload_schema, recording, schema_replay, user_files
from strategies import DataProto


# -- building the hostile inputs -------------------------------------------------------------------
def _edit_meta(directory: Path, edit) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    edit(meta)
    (directory / "meta.json").write_text(json.dumps(meta))


def _huge_shape(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    (rec / "odd%2Fkey.memmap").write_bytes(bytes(256))

    def edit(meta):
        meta["shape"] = [10**6]
        for key in list(meta):
            if isinstance(meta[key], dict) and "type" in meta[key]:
                del meta[key]  # one tensor leaf left, claiming 8 TB
            elif isinstance(meta[key], dict) and key != "odd/key":
                del meta[key]
        meta["odd/key"].update(shape=[10**6, 10**6], dtype="torch.int64")

    _edit_meta(rec, edit)
    return rec


def _truncated_leaf(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    leaf = rec / "input_ids.memmap"
    leaf.write_bytes(leaf.read_bytes()[:100])
    return rec


def _missing_leaf(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    (rec / "input_ids.memmap").unlink()
    return rec


def _dotdot_key(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    (d / "escape.memmap").write_bytes(torch.ones(4).numpy().tobytes())  # what ../escape names
    _edit_meta(rec, lambda m: m.update({"../escape": dict(m["odd/key"])}))
    return rec


def _symlink_leaf_out(d: Path, out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    secret = out / "secret.bin"
    secret.write_bytes(bytes(4 * 9 * 8))  # the size input_ids claims
    (rec / "input_ids.memmap").unlink()
    (rec / "input_ids.memmap").symlink_to(secret)
    return rec


def _symlink_dir_out(d: Path, out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    shutil.move(str(rec / "nest"), str(out / "nest"))
    (rec / "nest").symlink_to(out / "nest", target_is_directory=True)
    return rec


def _fifo_leaf(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    (rec / "input_ids.memmap").unlink()
    os.mkfifo(rec / "input_ids.memmap")
    return rec


def _fifo(d: Path, _out: Path, _m: Path) -> Path:
    os.mkfifo(d / "pipe")
    return d / "pipe"


def _memmap_bad_dtype(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    _edit_meta(rec, lambda m: m["input_ids"].update(dtype="torch.cuda"))
    return rec


def _memmap_not_json(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    (rec / "meta.json").write_bytes(b"\x80\x04not json")
    return rec


def _memmap_deep(d: Path, _out: Path, _m: Path) -> Path:
    level = rec = d / "rec"
    for _ in range(40):
        level.mkdir()
        meta = {
            "shape": [2],
            "_type": "<class 'tensordict._td.TensorDict'>",
            "n": {"type": "TensorDict"},
        }
        (level / "meta.json").write_text(json.dumps(meta))
        level = level / "n"
    return rec


def _memmap_foreign_class(d: Path, _out: Path, _m: Path) -> Path:
    rec = memmap_recording(d / "rec")
    _edit_meta(rec, lambda m: m.update(_type="<class 'evil_pkg.Boom'>", _class="evil_pkg:Boom"))
    return rec


def _memmap_pickled_leaf(d: Path, _out: Path, marker: Path) -> Path:
    return evil_memmap(d / "rec", marker)


def _memmap_pickled_stack(d: Path, _out: Path, marker: Path) -> Path:
    return evil_memmap(d / "rec", marker, stack=True)


def _torch_save_code(d: Path, _out: Path, marker: Path) -> Path:
    torch.save({"batch": RunsCode(marker)}, d / "evil.pt")
    return d / "evil.pt"


def _torch_save_shell(d: Path, _out: Path, marker: Path) -> Path:
    torch.save({"batch": RunsShell(marker)}, d / "shell.pt")
    return d / "shell.pt"


def _pickle_code(d: Path, _out: Path, marker: Path) -> Path:
    (d / "evil.pkl").write_bytes(pickle.dumps({"batch": RunsCode(marker)}))
    return d / "evil.pkl"


def _pickle_user_class(d: Path, _out: Path, _m: Path) -> Path:
    (d / "tag.pkl").write_bytes(pickle.dumps({"batch": Tag("x")}))
    return d / "tag.pkl"


def _torch_save_truncated(d: Path, _out: Path, _m: Path) -> Path:
    data = torch_recording(d / "whole.pt").read_bytes()
    (d / "whole.pt").unlink()
    (d / "cut.pt").write_bytes(data[: len(data) * 2 // 3])
    return d / "cut.pt"


def _expanded_view(d: Path, _out: Path, _m: Path) -> Path:
    # One element stored, 10^12 claimed through zero strides: a copy would take 4 TB.
    view = torch.zeros(1).expand(10**6, 10**6)
    torch.save(TensorDict({"x": view}, batch_size=[10**6]), d / "view.pt")
    return d / "view.pt"


def _schema_as_file(d: Path, _out: Path, _m: Path) -> Path:
    shutil.copy(CONF_DIR / "schemas" / "rl_rollout.yaml", d / "s.yaml")
    return d / "s.yaml"


def _small_recording(d: Path, _out: Path, _m: Path) -> Path:
    return torch_recording(d / "rec.pt")


def _torch_save_as_schema(d: Path, _out: Path, _m: Path) -> Path:
    return torch_recording(d / "rec.pt")


def _pickle_as_schema(d: Path, _out: Path, _m: Path) -> Path:
    (d / "rec.pkl").write_bytes(pickle.dumps({"batch": None}))
    return d / "rec.pkl"


def _memmap_as_schema(d: Path, _out: Path, _m: Path) -> Path:
    return memmap_recording(d / "rec")


def _schema_with(edit):
    """A builder: the shipped rl_rollout schema with one edit."""

    def build(d: Path, _out: Path, _m: Path) -> Path:
        doc = yaml.safe_load((CONF_DIR / "schemas" / "rl_rollout.yaml").read_text())
        edit(doc)
        (d / "s.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        return d / "s.yaml"

    return build


def _schema_text(text: str):
    def build(d: Path, _out: Path, _m: Path) -> Path:
        (d / "s.yaml").write_text(text)
        return d / "s.yaml"

    return build


def _leaf0(**fields):
    return lambda doc: doc["leaves"][0].update(fields)


def _jagged(percentile_top: float):
    entry = {
        "key": ["ragged"], "kind": "jagged", "dtype": "int64", "trailing_shape": [],
        "lengths": {"percentiles": [1.0] * 10 + [percentile_top]},
    }  # fmt: skip
    return lambda doc: doc["leaves"].append(entry)


def _long_strings(doc):
    doc["non_tensor_batch"]["uid"]["lengths"]["percentiles"][-1] = 1e12


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"

# name: (payload, builder, extra overrides, what the one line must say)
CASES = {
    "memmap pickled leaf runs code": ("file", _memmap_pickled_leaf, [], "needs io.open"),
    "memmap pickled stack runs code": ("file", _memmap_pickled_stack, [], "needs io.open"),
    "memmap claims [1e6,1e6] int64 on 256 B": ("file", _huge_shape, [], "8,000,000,000,000 bytes"),
    "memmap truncated leaf": ("file", _truncated_leaf, [], "input_ids.memmap is truncated"),
    "memmap missing leaf": ("file", _missing_leaf, [], "input_ids.memmap is missing"),
    "memmap key with ../": ("file", _dotdot_key, [], "..%2Fescape.memmap is missing"),
    "memmap leaf symlinked out": ("file", _symlink_leaf_out, [], "points outside the directory"),
    "memmap dir symlinked out": ("file", _symlink_dir_out, [], "points outside the directory"),
    "memmap leaf is a FIFO": ("file", _fifo_leaf, [], "is a FIFO; only regular files"),
    "memmap dtype torch.cuda": ("file", _memmap_bad_dtype, [], "unknown dtype 'torch.cuda'"),
    "memmap meta.json not JSON": ("file", _memmap_not_json, [], "meta.json is not JSON"),
    "memmap 40 levels deep": ("file", _memmap_deep, [], "nested more than 32 deep"),
    "memmap foreign class": ("file", _memmap_foreign_class, [], "saved a evil_pkg.Boom"),
    "FIFO as payload.path": ("file", _fifo, [], "is a FIFO; a recording is a regular file"),
    "torch.save runs code": ("file", _torch_save_code, [], "needs io.open"),
    "torch.save runs a shell": ("file", _torch_save_shell, [], "needs posix.system"),
    "pickle runs code": ("file", _pickle_code, [], "needs io.open"),
    "pickle of a user class": ("file", _pickle_user_class, [], "needs hostile_support.Tag"),
    "torch.save truncated": ("file", _torch_save_truncated, [], "truncated or corrupt torch.save"),
    "torch.save 10^12-element view": ("file", _expanded_view, [], "> payload.max_bytes="),
    "schema YAML as payload=file": ("file", _schema_as_file, [], "replay it with payload=schema"),
    "file over payload.max_bytes": (
        "file",
        _small_recording,
        ["payload.max_bytes=100"],
        "bytes > payload.max_bytes=100",
    ),
    "resampled batch over the limit": (
        "file",
        _small_recording,
        ["payload.batch_size=100000", "payload.max_bytes=1000000"],
        "payload.batch_size: 100,000 rows × 93 bytes per row = 9,300,000 bytes",
    ),
    "payload.max_bytes=0": ("file", _small_recording, ["payload.max_bytes=0"], "positive integer"),
    "torch.save as payload=schema": ("schema", _torch_save_as_schema, [], "it is a torch.save"),
    "pickle as payload=schema": ("schema", _pickle_as_schema, [], "(it is a pickle)"),
    "memmap dir as payload=schema": ("schema", _memmap_as_schema, [], "is a directory"),
    "FIFO as payload=schema": ("schema", _fifo, [], "is not a regular file"),
    "schema dim true": ("schema", _schema_with(_leaf0(shape=[True])), [], "non-negative integers"),
    "schema dim 1.5": ("schema", _schema_with(_leaf0(shape=[1.5])), [], "non-negative integers"),
    "schema dim '8'": ("schema", _schema_with(_leaf0(shape=["8"])), [], "non-negative integers"),
    "schema dim -1": ("schema", _schema_with(_leaf0(shape=[-1])), [], "non-negative integers"),
    "schema dtype cuda": ("schema", _schema_with(_leaf0(dtype="cuda")), [], "unknown dtype 'cuda'"),
    "schema dtype Tensor": ("schema", _schema_with(_leaf0(dtype="Tensor")), [], "unknown dtype"),
    "schema kind pickle": ("schema", _schema_with(_leaf0(kind="pickle")), [], "kind is 'pickle'"),
    "schema without leaves": (
        "schema",
        _schema_with(lambda doc: doc.pop("leaves")),
        [],
        "leaves must be a list",
    ),
    "schema leaf without key": (
        "schema",
        _schema_with(lambda doc: doc["leaves"][0].pop("key")),
        [],
        "key must be a list",
    ),
    "schema key 1000 deep": (
        "schema",
        _schema_with(_leaf0(key=["k"] * 1000)),
        [],
        "1 to 32 names",
    ),
    "schema unknown field": ("schema", _schema_with(_leaf0(pickle="x")), [], "unknown fields"),
    "schema YAML 1000 deep": (
        "schema",
        _schema_text("leaves: " + "[" * 1000 + "]" * 1000),
        [],
        "not a schema YAML: ",
    ),
    "schema YAML 100000 deep": (
        "schema",
        _schema_text("a:\n" + "- " * 100000 + "x\n"),
        [],
        "nests deeper than 32",
    ),
    "schema YAML alias bomb": ("schema", _schema_text(BILLION_LAUGHS), [], "uses an alias"),
    "schema jagged lengths 1e12": (
        "schema",
        _schema_with(_jagged(1e12)),
        [],
        "rows up to 1,000,000,000,000 long",
    ),
    "schema string lengths 1e12": (
        "schema",
        _schema_with(_long_strings),
        [],
        "strings up to 1,000,000,000,000 long",
    ),
    "schema batch_size × shape": (
        "schema",
        _schema_with(_leaf0(shape=[10**6])),
        ["payload.batch_size=1000000"],
        "payload.batch_size=1,000,000 rows × ",
    ),
    "schema 10^12 elements": (
        "schema",
        _schema_with(_leaf0(shape=[10**6, 10**6])),
        [],
        "shape [1000000, 1000000]",
    ),
    "schema percentiles decreasing": (
        "schema",
        _schema_with(
            lambda doc: doc["non_tensor_batch"]["uid"]["lengths"].update(
                percentiles=list(range(11, 0, -1))
            )
        ),
        [],
        "non-decreasing",
    ),  # fmt: skip
    "schema numpy sub-array dtype": (
        "schema",
        _schema_with(lambda doc: doc["non_tensor_batch"]["uid"].update(dtype="(1000,1000)f8")),
        [],
        "not a plain numpy dtype",
    ),  # fmt: skip
}


@pytest.fixture
def places(tmp_path):
    """(inputs dir, a dir outside the recording, the marker code would create, Hydra's dir)."""
    dirs = [tmp_path / name for name in ("in", "outside", "hydra")]
    for d in dirs:
        d.mkdir()
    return dirs[0], dirs[1], tmp_path / "marker", dirs[2]


THROUGH_THE_CLI = (
    "memmap pickled leaf runs code", "memmap claims [1e6,1e6] int64 on 256 B",
    "FIFO as payload.path", "torch.save truncated", "torch.save as payload=schema",
    "schema YAML 100000 deep", "schema jagged lengths 1e12", "schema dtype cuda",
)  # fmt: skip
"""Cases also run through the whole `bcastbench run` (Hydra included); every case runs through
the job's validation and the CLI's error printer."""


def _check_refusal(case, status, err, took, snapshot_before, places, within=QUICK_S) -> None:
    inputs, outside, marker, _ = places
    says = CASES[case][3]
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("bcastbench: error: payload."), err
    assert says in err[0], err[0]
    assert "Traceback" not in err[0] and took < within, (took, err)
    assert snapshot(inputs, outside) == snapshot_before, "an input changed"
    assert not marker.exists(), "code from the recording ran"
    if "runs code" in case or "user class" in case or "shell" in case:
        assert "payload.trust=true" in err[0]


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_one_line_exit_2_and_harmless(case, places, capsys):
    """The job's validation of the payload, and the CLI's printer for what it raises."""
    from harness.commands import run as cli
    from harness.errors import ConfigError
    from harness.job.config import _validate_recorded
    from harness.job.config_schema import PayloadConf

    payload, build, extra, _ = CASES[case]
    path = build(*places[:3])
    before = snapshot(*places[:2])
    overrides = dict(arg.removeprefix("payload.").split("=") for arg in extra)
    node = OmegaConf.merge(
        OmegaConf.structured(PayloadConf), {"name": payload, "path": str(path), **overrides}
    )
    capsys.readouterr()
    start = time.monotonic()
    try:
        _validate_recorded(node, node.batch_size)
        status = 0
    except ConfigError as exc:
        status = cli._exit_status(exc)
    took = time.monotonic() - start
    _check_refusal(case, status, capsys.readouterr().err.strip().splitlines(), took, before, places)


@pytest.mark.parametrize("case", THROUGH_THE_CLI)
def test_hostile_input_through_bcastbench_run(case, places, capsys, monkeypatch):
    payload, build, extra, _ = CASES[case]
    path = build(*places[:3])
    before = snapshot(*places[:2])
    argv = [f"payload={payload}", f"payload.path={path}", *extra, f"hydra.run.dir={places[3]}"]
    status, err, took = run_cli(argv, capsys, monkeypatch)
    _check_refusal(case, status, err, took, before, places, within=CLI_S)


@pytest.mark.parametrize(
    "build", [_memmap_pickled_leaf, _torch_save_code, _pickle_code], ids=["memmap", "torch", "pkl"]
)
def test_schema_command_refuses_code_naming_its_own_flag(build, places, capsys, monkeypatch):
    inputs, outside, marker, _ = places
    path = build(inputs, outside, marker)
    out = outside / "schema.yaml"
    before = snapshot(inputs)
    status, err, took = run_cli(["schema", str(path), "-o", str(out)], capsys, monkeypatch)
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("bcastbench schema: error: ") and "needs io.open" in err[0]
    assert "--trust" in err[0] and "payload.trust" not in err[0], err[0]
    assert not marker.exists() and not out.exists() and snapshot(inputs) == before
    assert took < QUICK_S


def test_schema_command_never_writes_over_its_input(places, capsys, monkeypatch):
    inputs, _, _, _ = places
    rec = torch_recording(inputs / "rec.pt")
    before = snapshot(inputs)
    status, err, _ = run_cli(["schema", str(rec), "-o", str(rec)], capsys, monkeypatch)
    assert status == 2 and "would overwrite the recording" in err[0]
    assert snapshot(inputs) == before


def test_schema_command_with_trust_reads_a_pickled_leaf(tmp_path, capsys, monkeypatch):
    rec, out = tagged_memmap(tmp_path / "rec"), tmp_path / "schema.yaml"
    status, err, _ = run_cli(["schema", str(rec), "-o", str(out), "--trust"], capsys, monkeypatch)
    assert status == 0 and out.exists(), err
    leaves = {tuple(e["key"]): e for e in yaml.safe_load(out.read_text())["leaves"]}
    assert leaves[("tag",)]["items"] == "Tag"


def test_every_reader_refuses_the_same_pickle(tmp_path):
    """The job's validation, a replica leader's payload (what the pytest plugin's jobs build)
    and bcastbench schema's reader all go through recording.load: none runs the pickle."""
    from harness.errors import ConfigError
    from harness.job.config import _validate_recorded
    from harness.job.config_schema import PayloadConf
    from harness.payload import source

    marker = tmp_path / "marker"
    rec = evil_memmap(tmp_path / "rec", marker)
    node = OmegaConf.merge(OmegaConf.structured(PayloadConf), {"name": "file", "path": str(rec)})
    with pytest.raises(ConfigError, match="needs io.open"):
        _validate_recorded(node, node.batch_size)
    one_line_error(lambda: source.open_payload("file", str(rec), False, None, 4))
    text, _ = one_line_error(lambda: recording.load(rec, flags=user_files.SCHEMA_FLAGS))
    assert "--trust" in text and not marker.exists()
    trusted = {"path": str(tagged_memmap(tmp_path / "t")), "trust": True}
    trusted_node = OmegaConf.merge(node, trusted)
    _validate_recorded(trusted_node, trusted_node.batch_size)


def test_trust_lifts_only_the_pickle_refusal(tmp_path):
    marker = tmp_path / "marker"
    rec = evil_memmap(tmp_path / "rec", marker)
    one_line_error(lambda: recording.load(rec))
    assert not marker.exists()
    recording.load(rec, trust=True)
    assert marker.exists()  # trusted: the pickle ran, as the user allowed
    tagged = tagged_memmap(tmp_path / "tagged")
    text, _ = one_line_error(lambda: recording.load(tagged))
    assert "needs hostile_support.Tag" in text
    got = recording.load(tagged, trust=True)
    assert got.batch.get("tag").data == Tag("mine")
    huge = _huge_shape(tmp_path, tmp_path, marker)
    text, _ = one_line_error(lambda: recording.load(huge, trust=True))
    assert "truncated" in text  # trust never lifts a size check


def test_memmap_reader_matches_tensordicts_own_loader(tmp_path):
    """Every leaf kind, read by our reader, equals what TensorDict.load_memmap reads (a nested
    tensor comes back jagged, the layout the codecs carry)."""
    rec = memmap_recording(tmp_path / "rec")
    before = snapshot(rec)
    ours = recording.load(rec).batch
    theirs = TensorDict.load_memmap(rec, allow_pickle=False, mode="r")
    assert snapshot(rec) == before
    for key in ("input_ids", "mask", ("nest", "logp"), "odd/key"):
        assert torch.equal(ours[key], theirs[key]) and ours[key].dtype == theirs[key].dtype
    assert ours["ragged"].layout == torch.jagged
    assert all(
        torch.equal(a, b) for a, b in zip(ours["ragged"].unbind(0), theirs["ragged"].unbind(0))
    )
    assert (
        ours.get("note").data == "hello"
        and ours.get("texts").tolist() == theirs.get("texts").tolist()
    )


def test_recorded_batch_reports_its_real_seq_len(tmp_path):
    rec = memmap_recording(tmp_path / "rec")
    assert recording.seq_len_of(recording.load(rec)) == 9
    assert recording.seq_len_of(recording.make(str(rec), 16)) == 9
    only_1d = DataProto(TensorDict({"r": torch.ones(3)}, batch_size=[3]), {}, {})
    assert recording.seq_len_of(only_1d) is None
    ragged = torch.nested.nested_tensor([torch.ones(n) for n in (2, 7, 3)], layout=torch.jagged)
    jagged = DataProto(TensorDict({"ids": ragged}, batch_size=[3]), {}, {})
    assert recording.seq_len_of(jagged) == 7
    replayed = schema_replay.make(str(CONF_DIR / "schemas" / "rl_rollout.yaml"), 2, seed=0)
    assert recording.seq_len_of(replayed) == 1024


def test_default_limit_is_a_quarter_of_this_machines_memory():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert user_files.default_max_bytes() == physical // 4


def test_schema_bytes_per_row_are_its_shapes_arithmetic():
    doc = yaml.safe_load((CONF_DIR / "schemas" / "rl_rollout.yaml").read_text())
    tensors = sum(
        math.prod(e["shape"]) * user_files.DTYPES[e["dtype"]].itemsize for e in doc["leaves"]
    )
    strings = sum(  # a pointer, the str's own bytes and its longest text
        8 + 8 + math.ceil(e["lengths"]["percentiles"][-1]) for e in doc["non_tensor_batch"].values()
    )
    assert payload_schema.validate(doc) == tensors + strings
    with pytest.raises(
        payload_schema.SchemaError, match=rf"2 rows × {tensors + strings:,} bytes per row"
    ):
        payload_schema.validate(doc, batch_size=2, max_bytes=tensors)


def test_the_pytest_plugin_refuses_an_unsafe_recording_before_any_rank(tmp_path):
    """bcastbench_job reads a recorded payload with the loader every command uses, on the
    driver: code in a pickle is refused in one line naming the trust flag."""
    import pickle

    from harness.job.spec import JobSpec
    from harness.pytest_plugin.jobs import check_payload
    from strategies.core.layout import Layout

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(Evil()))
    spec = JobSpec("header", Layout(tp=2, pp=2), payload="file", payload_path=str(path))
    with pytest.raises(ValueError, match="payload.trust=true") as err:
        check_payload(spec)
    assert len(str(err.value).splitlines()) == 1 and not marker.exists()


def test_the_pytest_plugin_prices_a_generated_payload_before_any_rank():
    """A batch no machine holds (a typo'd batch_size in a user's CI) is one line before the
    world is asked for, priced as bcastbench run prices it."""
    from harness.job.spec import JobSpec
    from harness.pytest_plugin.jobs import check_payload
    from strategies.core.layout import Layout

    spec = JobSpec("header", Layout(tp=2, pp=2), batch_size=10**12, seq_len=512)
    with pytest.raises(ValueError, match=r"of 1000000000000 rows × 512 tokens takes") as err:
        check_payload(spec)
    assert len(str(err.value).splitlines()) == 1
    check_payload(JobSpec("header", Layout(tp=2, pp=2), batch_size=2, seq_len=512))


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"batch_size": 0}, "job: batch_size must be an int >= 1, got 0"),
        ({"seq_len": -4}, "job: seq_len must be an int >= 1, got -4"),
        ({"iters": 2.5}, "job: iters must be an int >= 1, got 2.5"),
        ({"warmup": -1}, "job: warmup must be an int >= 0, got -1"),
        ({"timeout_s": 0}, "job: timeout_s must be positive seconds, got 0"),
        ({"time_budget_s": "1"}, "job: time_budget_s must be positive seconds, got '1'"),
    ],
)
def test_a_job_of_no_rows_or_no_calls_is_refused_whoever_builds_it(fields, says):
    """The CLI's config check refuses these; a job built elsewhere (the pytest plugin's gate, a
    script) is refused the same, in one line, before any rank: a gate of batch_size=0 ran a job
    of the non-tensor batch alone and reported it."""
    import re

    from harness.job.spec import JobSpec
    from strategies.core.layout import Layout

    with pytest.raises(ValueError, match="^" + re.escape(says) + "$"):
        JobSpec("header", Layout(tp=2, pp=2), **fields)
