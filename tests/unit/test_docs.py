"""The README and docs/ cannot rot: every command they show runs here, or is checked without
running a job, and every relative link they hold points at a file (and heading) that exists.

Each command of a fenced ``bash`` or ``console`` block (a console block's ``$`` lines) is one
test, handled by the first rule of ``plan`` that fits:

- **run** for real, when it is cheap: ``bcastbench --help``, any ``--help`` or ``--cfg``,
  ``predict`` (every target), ``schema``, ``validate target=ray``, ``validate target=emulated
  source=...``, ``calibrate target=store`` (``--dry-run``), ``compare`` (its inputs are small),
  and ``report`` (either target) or ``validate`` of a directory of at most ``SMALL_DIR``
  records. A command is known by its verb and target (``harness.commands.cli.parse``), an old
  name's by the ones it stands for. It runs in
  process, in a scratch directory per page that holds copies of the repository paths the command
  names and the files the pages use as a user's own (``PROPS``), so nothing committed changes.
- **checked**, nothing started: ``bcastbench run`` and ``bench`` with ``--check`` (every job
  composed and validated); the other Hydra apps through their own check of every job; a larger
  records directory by its records; ``torchrun``/``srun`` lines by their ``-m harness``
  arguments; ``make`` targets with ``make -n``; pytest commands with ``--collect-only``.
- **skipped**: a block right after ``<!-- docs-test: skip (reason) -->``; the reason shows as
  the skip's, and ``MAX_SKIPPED`` keeps them few.

A command no rule covers, or one holding a ``<placeholder>``, fails: give it a rule here, write
a concrete value, or mark its block.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.commands import cli
from harness.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->")
MAX_SKIPPED = 6
"""Commands the docs may show without this test running or checking them."""
SMALL_DIR = 40
"""Records a directory may hold for ``report``/``collect``/``validate`` to run on it here
(the bench reference's 156 take longer than this whole test should)."""
BCASTBENCH = {"bcastbench", ".venv/bin/bcastbench"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
RUNS = {("predict", "layout"), ("predict", "scale"), ("predict", "ray"), ("schema", "file"),
        ("validate", "ray")}  # fmt: skip
"""(verb, target)s cheap enough to run for real (no world, no cluster)."""
HYDRA_APPS = {("calibrate", "cluster"), ("calibrate", "ray"), ("validate", "emulated"),
              ("run", "dispatch"), ("run", "dispatch-emulated")}  # fmt: skip
"""Config-shaped targets that start worlds or clusters: checked, job by job."""
RECORD_READERS = {("report", "md"), ("report", "csv"), ("validate", "sweep")}
CHECKED = {("run", "job"), ("bench", "cpu")}
"""Targets with their own ``--check``: every job composed and validated, none started."""
STORE_FIT = ("calibrate", "store")
EXAMPLE_SRC = REPO / "examples" / "bcastbench_example_strategy" / "src"
"""On the path of every command, as writing-a-strategy.md puts it (``PYTHONPATH``)."""
SHAPES_YAML = "- {batch_size: 768, seq_len: 512}\n- {batch_size: 3, seq_len: 1024}\n"


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{' '.join(self.argv[:3])}"


@dataclass(frozen=True)
class Plan:
    kind: str  # run | check | skip
    how: str  # what the test does with it, in words


def _fenced(path: Path):
    """(language, line number of the first line, lines, skip reason) of each fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        before = next((s for s in reversed(lines[:i]) if s.strip()), "")
        skip = SKIP_MARK.search(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        yield opening.group(1), i + 2, lines[i + 1 : end], skip.group(1) if skip else None
        i = end + 1


def _shell_lines(lang: str, first: int, lines: list[str]):
    """(line number, text) of each command: continuations joined, console output left out."""
    pending, start = "", 0
    for n, raw in enumerate(lines, first):
        text = raw
        if lang == "console" and not pending:
            if not raw.startswith("$ "):
                continue
            text = raw[2:]
        if not pending:
            start = n
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        yield start, pending + text
        pending = ""


def commands(path: Path, root: Path = REPO) -> list[Command]:
    found = []
    for lang, first, lines, skip in _fenced(path):
        if lang not in ("bash", "console"):
            continue
        for line, text in _shell_lines(lang, first, lines):
            argv = shlex.split(text, comments=True)
            while argv:  # `a && b` is two commands
                cut = argv.index("&&") if "&&" in argv else len(argv)
                found.append(Command(str(path.relative_to(root)), line, tuple(argv[:cut]), skip))
                argv = argv[cut + 1 :]
    return found


ALL = [c for page in PAGES for c in commands(page)]


def bcastbench_args(argv: tuple[str, ...]) -> list[str] | None:
    """The arguments of a ``bcastbench`` (or ``python -m harness``) command, else None."""
    if argv[0] in BCASTBENCH:
        return list(argv[1:])
    if argv[0] in PYTHONS and argv[1:3] == ("-m", "harness"):
        return list(argv[3:])
    return None


def _harness_part(argv: tuple[str, ...]) -> list[str] | None:
    """What a launcher (torchrun, srun) hands ``-m harness``."""
    for i in range(len(argv) - 1):
        if argv[i : i + 2] == ("-m", "harness"):
            return list(argv[i + 2 :])
    return None


def subcommand(args: list[str]) -> tuple[tuple[str, str], list[str]]:
    """((verb, target), the target's own arguments) of a ``bcastbench`` command line."""
    call = cli.parse(args)
    return (call.verb, call.target), list(call.args)


def sub_argv(sub: tuple[str, str]) -> list[str]:
    """The command line's words that name ``(verb, target)``."""
    verb, target = sub
    return [verb] if target == cli.VERBS[verb].default else [verb, f"target={target}"]


def plan(cmd: Command) -> Plan | None:
    """How the test handles ``cmd`` (None: no rule fits)."""
    if cmd.skip:
        return Plan("skip", cmd.skip)
    argv = cmd.argv
    args = bcastbench_args(argv)
    if args is not None:
        if not args or args[0] in ("-h", "--help", "help"):
            return Plan("run", "the usage")
        sub, rest = subcommand(args)
        if {"--help", "-h", "--cfg", "-c"} & set(rest):
            return Plan("run", "Hydra shows, nothing runs")
        if sub in CHECKED:
            return Plan("check", f"{sub[0]} --check")
        if sub[0] == "compare":
            return Plan("run", "on copies of both inputs")
        if sub == STORE_FIT:
            return Plan("run", "--dry-run on a copy: the preset stays as it is")
        if sub in RECORD_READERS:
            small = _records(_positional(rest)) <= SMALL_DIR
            return Plan("run", "on a copy") if small else Plan("check", "the records are there")
        re_read = sub == ("validate", "emulated") and any(a.startswith("source=") for a in rest)
        if sub in RUNS or re_read:
            return Plan("run", "in a scratch directory")
        if sub in HYDRA_APPS:
            return Plan("check", "every job composed and checked")
        return None
    if argv[0] in ("torchrun", "srun") and _harness_part(argv) is not None:
        return Plan("check", "its -m harness arguments, run --check")
    if argv[0] == "make":
        return Plan("check", "make -n")
    if argv[0] == "pytest" or argv[1:3] == ("-m", "pytest"):
        return Plan("check", "pytest --collect-only")
    if argv[0] in PYTHONS and argv[1:4] == ("-m", "pytest_benchmark", "list"):
        return Plan("run", "lists saved benchmark runs")
    return None


def _positional(rest: list[str]) -> str:
    return next(a for a in rest if not a.startswith("-"))


def _records(directory: str) -> int:
    return sum(1 for _ in (REPO / directory).rglob("result.json"))


# -- running and checking --------------------------------------------------------------------


def _make_props(scratch: Path) -> None:
    """The files the pages use as a user's own: a recorded batch, its schema, a shapes file."""
    import torch
    from tensordict import TensorDict

    rows = 8
    batch = TensorDict(
        {
            "input_ids": torch.arange(rows * 64).reshape(rows, 64),
            "attention_mask": torch.ones(rows, 64, dtype=torch.bool),
        },
        batch_size=[rows],
    )
    torch.save(batch, scratch / "step100.pkl")
    (scratch / "shapes.yaml").write_text(SHAPES_YAML)
    here = Path.cwd()
    os.chdir(scratch)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["schema", "step100.pkl", "-o", "step100.yaml"]) == 0
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def scratches(tmp_path_factory):
    """One scratch directory per page, made on first use, with the props in it."""
    made: dict[str, Path] = {}

    def scratch(page: str) -> Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(Path(page).stem)
            _make_props(made[page])
        return made[page]

    return scratch


def _copy_named_paths(argv: tuple[str, ...], scratch: Path) -> None:
    """Copy into ``scratch`` every relative repository path the command names (as an argument,
    a ``key=value``'s value or an item of a ``[a,b]`` list), so it reads and writes copies."""
    for arg in argv:
        value = arg.split("=", 1)[-1].strip("[]'\"")
        for item in value.split(","):
            if not item or item.startswith(("-", "/")) or "/" not in item.rstrip("/"):
                continue
            source, target = REPO / item, scratch / item
            if not source.exists() or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy2(source, target)


def _in_process(argv: list[str], capsys) -> tuple[int, str]:
    """``bcastbench argv`` in this process: its exit status and what it printed."""
    from harness.job import config_schema

    # What a command says made the records it writes; later tests' jobs say their own.
    saved = list(config_schema.COMMAND)
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        config_schema.COMMAND[:] = saved
    out = capsys.readouterr()
    return status, out.out + out.err


def _checked_app(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """A config-shaped target with its own check of every job (the one it makes before its
    first job) and no job after it."""
    from harness.commands.hydra_app import check_all, store_schema

    module = importlib.import_module(cli.parse(args).module)

    def check_only(_module, config_name, _task, check, argv, schema=None):
        if schema is not None:
            store_schema(config_name, schema)
        print(f"{check_all(config_name, list(argv), check)} jobs checked; none started")
        return 0

    monkeypatch.setattr(module, "run_app", check_only)
    # Whether this machine can build network namespaces is the machine's business, not the
    # docs': the emulated commands' values are checked all the same.
    monkeypatch.setattr(module, "_namespaces_unavailable", lambda: None, raising=False)
    return _in_process(args, capsys)


def _subprocess(argv: list[str], env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env or os.environ.copy()
    )
    return done.returncode, done.stdout + done.stderr


def execute(cmd: Command, scratch: Path, monkeypatch, capsys) -> tuple[int, str]:
    """Run or check ``cmd`` as ``plan`` says; its exit status and output."""
    argv = cmd.argv
    args = bcastbench_args(argv)
    if args is None and _harness_part(argv) is not None:
        args = ["run", *_harness_part(argv)]
    if args is not None:
        monkeypatch.chdir(scratch)
        monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
        sub, rest = subcommand(args)
        kind = plan(cmd).kind
        if kind == "run":
            _copy_named_paths(argv, scratch)
            if sub == STORE_FIT and "--dry-run" not in rest:
                args = [*args, "--dry-run"]  # it writes the repository's preset, not a copy
            return _in_process(args, capsys)
        if sub in CHECKED:
            status, out = _in_process([*sub_argv(sub), "--check", *rest], capsys)
            assert status != 0 or "checked; none started" in out, out
            return status, out
        if sub in RECORD_READERS:
            directory = _positional(rest)
            assert _records(directory) > 0, f"{directory}: no result.json below it"
            return 0, ""
        return _checked_app(args, monkeypatch, capsys)
    if argv[0] == "make":
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        return _subprocess(["make", "-n", *argv[1:]], env)
    if argv[0] == "pytest" or argv[1:3] == ("-m", "pytest"):
        rest = list(argv[1:] if argv[0] == "pytest" else argv[3:])
        pytest_argv = ["--collect-only", "-q", "-p", "no:cacheprovider", *rest]
        return _subprocess([sys.executable, "-m", "pytest", *pytest_argv])
    return _subprocess([sys.executable, *argv[1:]])


DONE: dict[tuple[str, ...], tuple[int, str]] = {}
"""What each command line gave: one shown on two pages runs once."""


@pytest.mark.parametrize("cmd", ALL, ids=[c.id for c in ALL])
def test_every_command_runs_or_is_checked(cmd, scratches, monkeypatch, capsys):
    placeholders = [a for a in cmd.argv if re.search(r"<[^>]+>", a)]
    assert not placeholders, f"{cmd.id}: a placeholder {placeholders}: write a concrete value"
    how = plan(cmd)
    assert how is not None, (
        f"{cmd.id}: no rule runs or checks this command: add one to tests/unit/test_docs.py, "
        "or mark its block <!-- docs-test: skip (why) -->"
    )
    if how.kind == "skip":
        pytest.skip(f"docs-test: skip ({how.how})")
    if cmd.argv not in DONE:
        DONE[cmd.argv] = execute(cmd, scratches(cmd.page), monkeypatch, capsys)
    status, out = DONE[cmd.argv]
    assert status == 0, f"{cmd.id} ({how.kind}: {how.how}) exited {status}:\n{out[-3000:]}"


def test_the_docs_show_commands_and_skip_few():
    """The extraction finds the commands, most run or are checked, and the skipped ones are
    few and say why."""
    plans = [plan(c) for c in ALL]
    counts = {
        kind: sum(p is not None and p.kind == kind for p in plans)
        for kind in ("run", "check", "skip")
    }
    print(
        f"docs commands: {counts['run']} run, {counts['check']} checked, {counts['skip']} skipped"
    )
    assert counts["run"] >= 10 and counts["check"] >= 10, counts
    assert counts["skip"] <= MAX_SKIPPED, [
        c.id for c, p in zip(ALL, plans) if p and p.kind == "skip"
    ]


def test_the_cli_page_shows_every_verb_and_target():
    shown = {
        subcommand(args)[0]
        for c in commands(REPO / "docs" / "cli.md")
        if (args := bcastbench_args(c.argv)) is not None
    }
    every = {(name, target) for name, verb in cli.VERBS.items() for target in verb.targets}
    assert every <= shown, sorted(every - shown)


def test_the_docs_spell_commands_the_new_way():
    """No command a page shows goes by an old name (``cli.ALIASES``): the old names are for
    users' scripts, for one release."""
    old = [
        f"{c.id}: {' '.join(c.argv)}"
        for c in ALL
        if (args := bcastbench_args(c.argv) or _harness_part(c.argv)) and args[0] in cli.ALIASES
    ]
    assert old == [], old


# -- Python examples --------------------------------------------------------------------------


def test_python_examples_parse_and_name_the_public_api():
    """Every ``python`` block parses, and whatever it takes from ``strategies`` exists there."""
    import strategies

    for page in PAGES:
        for lang, first, lines, _ in _fenced(page):
            if lang != "python":
                continue
            tree = ast.parse("\n".join(lines), filename=f"{page.name}:{first}")
            named = {
                alias.name
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "strategies"
                for alias in node.names
            } | {
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "strategies"
            }
            missing = sorted(n for n in named if not hasattr(strategies, n))
            assert not missing, f"{page.name}:{first}: strategies has no {missing}"


# -- links ------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _without_blocks(path: Path) -> str:
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def _prose(path: Path) -> str:
    """The page without its fenced blocks and inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", _without_blocks(path))


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the page's headings (lower case, punctuation dropped, spaces to
    hyphens)."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", _without_blocks(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file (or heading) does not exist, and why."""
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(path):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_points_at_a_file(page):
    assert broken_links(page) == [], page.relative_to(REPO)


def test_the_checks_read_a_page_as_written(tmp_path):
    """The extraction and the link check on a page made for them: continuations, console
    prompts and their output, ``&&``, comments, the skip mark; a missing file, a missing
    heading, and links that are not links (in code, or absolute)."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\nbcastbench run \\\n    layout=tp2pp2  # one job\nmake a && make b\n```\n"
        "\n```console\n$ bcastbench --help\nusage: ...\n```\n"
        "\n<!-- docs-test: skip (needs a GPU) -->\n```bash\nbcastbench bench target=gpu\n```\n\n"
        "[ok](other.md#a-code-heading) [gone](nowhere.md) [bad](other.md#nope) [self](#page)\n"
        "`[in code](nowhere.md)` [web](https://example.org/x.md)\n"
    )
    found = [(c.line, c.argv, c.skip) for c in commands(page, tmp_path)]
    assert found == [
        (4, ("bcastbench", "run", "layout=tp2pp2"), None),
        (6, ("make", "a"), None),
        (6, ("make", "b"), None),
        (10, ("bcastbench", "--help"), None),
        (16, ("bcastbench", "bench", "target=gpu"), "needs a GPU"),
    ]
    assert broken_links(page) == ["nowhere.md: no such file", "other.md#nope: no heading #nope"]
