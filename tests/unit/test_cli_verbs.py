"""``bcastbench``'s verbs (issue 46): at most ten, each with its targets; every command name of
the last release still runs, as an alias that says its new spelling in one line; ``--help``
imports no command module (nor torch); no command's YAML sits at the top of ``conf/``."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from harness.commands import cli
from harness.paths import CONF_DIR, REPO

LAST_RELEASE = (
    "run", "bench", "predict", "calibrate", "extrapolate", "store-calibrate", "schema", "report",
    "collect", "validate", "compare", "emulated-table", "ray-dispatch", "ray-emulated",
    "ray-calibrate", "ray-model", "gpu-check",
)  # fmt: skip
"""The 17 subcommands ``bcastbench --help`` listed before the verbs."""
VERB_LINE = re.compile(r"^  (\S+)  ")
"""A verb's line of the usage: two spaces in (its targets are four)."""


def test_help_lists_at_most_ten_verbs_and_no_old_name(capsys):
    assert cli.main(["--help"]) == 0
    shown = [m.group(1) for line in capsys.readouterr().out.splitlines()
             if (m := VERB_LINE.match(line))]  # fmt: skip
    assert shown == list(cli.VERBS) and len(shown) <= 10, shown
    assert not set(shown) & set(cli.ALIASES)


def test_help_imports_no_command_module_nor_torch():
    code = (
        "import sys; from harness.commands import cli; cli.main(['--help']); "
        "print(' '.join(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.splitlines()[-1].split()
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "hydra", "omegaconf", "ray")]
    commands = [m for m in loaded if m.startswith("harness.commands.") and m != cli.__name__]
    assert heavy == [] and commands == [], (heavy, commands)


def test_every_name_of_the_last_release_is_a_verb_or_an_alias():
    assert set(LAST_RELEASE) == set(cli.VERBS) | set(cli.ALIASES)
    assert not set(cli.VERBS) & set(cli.ALIASES)


@pytest.mark.parametrize("old", sorted(cli.ALIASES))
def test_every_old_name_resolves_to_a_module_with_main(old):
    call = cli.parse([old, "x=1"])
    assert call.alias == old and call.prog == f"bcastbench {old}"
    assert call.argv == ["x=1"]  # no target's fixed arguments: it does exactly what it did
    assert callable(importlib.import_module(call.module).main)
    # Its new spelling runs the same module.
    new = cli.parse(cli.ALIASES[old].spelling().split()[1:])
    assert new.alias is None and new.module == call.module


@pytest.mark.parametrize(
    "argv, verb, target, module_argv",
    [
        (["strategy=flat"], "run", "job", ["strategy=flat"]),
        (["run", "-m", "target=dispatch", "iters=2"], "run", "dispatch", ["-m", "iters=2"]),
        (["calibrate"], "calibrate", "cluster", []),
        (["calibrate", "target=store", "DIR", "--dry-run"], "calibrate", "store",
         ["DIR", "--dry-run"]),
        (["validate", "records=[a.json]", "target=ray"], "validate", "ray",
         ["task=validate", "records=[a.json]"]),
        (["report", "target=csv", "DIR"], "report", "csv", ["DIR"]),
        (["compare", "target=x", "NEW"], "compare", "runs", ["target=x", "NEW"]),
    ],
)  # fmt: skip
def test_a_target_may_stand_anywhere_the_first_is_default(argv, verb, target, module_argv):
    call = cli.parse(argv)
    assert (call.verb, call.target, call.argv) == (verb, target, module_argv)
    default = target == cli.VERBS[verb].default
    assert call.prog == f"bcastbench {verb}" + ("" if default else f" target={target}")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["predict", "target=nope"], "bcastbench predict: error: target=nope: one of layout, "),
        (["calibrate", "target=ray", "target=store"], "target= given twice"),
        (["-m", "target=dispatch,job"], "bcastbench run: error: target=dispatch,job: one of"),
    ],
)
def test_a_target_the_verb_lacks_is_one_line_and_exit_2(argv, says, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_an_alias_says_its_new_spelling_in_one_line_then_does_what_it_did(capsys):
    assert cli.main(["ray-calibrate", "--cfg", "job"]) == 0
    old = capsys.readouterr()
    assert old.err.strip() == (
        "bcastbench ray-calibrate: now `bcastbench calibrate target=ray`; "
        "this alias goes in the next release"
    )
    assert cli.main(["calibrate", "target=ray", "--cfg", "job"]) == 0
    new = capsys.readouterr()
    assert new.out == old.out and "reps:" in new.out and new.err == ""


def test_no_command_yaml_at_the_top_of_conf():
    """The job's ``config.yaml`` alone; each command's is ``conf/commands/<module>.yaml``."""
    assert sorted(p.name for p in CONF_DIR.glob("*.yaml")) == ["config.yaml"]
    apps = {"predict", "extrapolate", "calibrate", "ray_calibrate", "ray_model", "ray_dispatch",
            "ray_emulated", "emulated_table"}  # fmt: skip
    assert {p.stem for p in (CONF_DIR / "commands").glob("*.yaml")} == apps
    for name in apps:
        assert f"harness.commands.{name}" in {
            target.module for verb in cli.VERBS.values() for target in verb.targets.values()
        }
