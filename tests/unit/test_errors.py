"""harness.errors: the one-line error and exit status every command shares, and the program
name it prints (``bcastbench <sub>`` through the CLI, ``python -m <module>`` run directly)."""

from __future__ import annotations

import sys

import pytest

from harness import errors


def test_program_name_follows_how_the_command_was_called(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bcastbench predict", "layout.dp=2"])
    assert errors.program("harness.commands.predict") == "bcastbench predict"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/bcastbench", "x"])
    assert errors.program("harness.commands.predict") == "/usr/bin/bcastbench"
    monkeypatch.setattr(sys, "argv", ["/repo/harness/commands/predict.py"])
    assert errors.program("harness.commands.predict") == "python -m harness.commands.predict"


def test_usage_error_is_one_line_with_the_cause(capsys):
    try:
        try:
            raise KeyError("inner reason\nsecond line")
        except KeyError as inner:
            raise ValueError("outer problem\nmore detail") from inner
    except ValueError as exc:
        status = errors.usage_error("bcastbench", exc, "; valid keys: a, b")
    err = capsys.readouterr().err
    assert status == errors.USAGE_EXIT == 2
    assert err.count("\n") == 1
    assert err.startswith("bcastbench: error: outer problem (")
    assert "inner reason" in err and err.rstrip().endswith("; valid keys: a, b")


def test_one_place_for_the_helpers():
    """The CLI and the cost model's apps use harness.errors' helpers, not copies of them."""
    import inspect

    from harness.commands import hydra_app, run

    for module in (hydra_app, run):
        source = inspect.getsource(module)
        assert "def one_line" not in source and "harness.errors" in source, module.__name__


@pytest.mark.parametrize("via_cli", [True, False])
def test_cost_model_errors_name_the_program_as_called(via_cli, capsys, monkeypatch):
    from harness.commands import cli

    monkeypatch.setattr(sys, "argv", ["/repo/harness/commands/predict.py"])
    from harness.commands.predict import main

    with pytest.raises(SystemExit) as exit_:
        cli.main(["predict", "layout.dp=0"]) if via_cli else main(["layout.dp=0"])
    status = exit_.value.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    prog = "bcastbench predict" if via_cli else "python -m harness.commands.predict"
    assert err.startswith(f"{prog}: error: "), err


@pytest.mark.parametrize(
    "modes", [["-m", "--cfg", "job"], ["--multirun", "-c", "job"], ["-m", "--info"]]
)
def test_two_hydra_modes_are_one_line_and_exit_2(modes, capsys):
    """Hydra refuses a sweep with --cfg (or --info) by raising a bare ValueError with its stack;
    the command says what clashes in one line, before anything is composed."""
    from harness.commands import cli

    status = cli.main([*modes, "strategy=header,flat"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("bcastbench: error: ") and "given together" in err
