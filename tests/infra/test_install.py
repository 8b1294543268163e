"""A real install, tier 3: the wheel ``pip wheel .`` builds is installed with its declared
dependencies, resolved by pip, into a clean venv, and from a directory that is not the checkout
it answers ``bcastbench run --help``, runs a job, writes its report and serves the pytest
plugin. Only torch is put in first, from the same pin as the Makefile (``TORCH_SPEC``), so pip
takes the CPU build this machine's pip serves instead of resolving the CUDA one: the checkout's
own torch where it is that pin (linked, not unpacked again), else ``pip install TORCH_SPEC``.

This is what a new user's ``pip install`` does, so a dependency the product imports but does
not declare fails here, not on their machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from harness.paths import REPO

pytestmark = pytest.mark.slow

GATE = """
def test_gate(bcastbench_job):
    summary = bcastbench_job(strategy="header", layout="tp2pp2", batch_size=2, seq_len=64)
    assert summary["vs_floor"] > 0 and summary["vs_baseline"] > 0
    assert summary["collectives_per_call"] >= 1
"""


def torch_spec() -> str:
    """The torch requirement ``make`` installs: ``TORCH_SPEC`` from the environment (make
    exports it to the tests) or the Makefile's default."""
    if os.environ.get("TORCH_SPEC"):
        return os.environ["TORCH_SPEC"]
    match = re.search(r"^TORCH_SPEC \?= (\S+)", Path(REPO, "Makefile").read_text(), re.M)
    assert match, "the Makefile sets no TORCH_SPEC"
    return match.group(1)


def pip(python: Path, *args: str, timeout: int = 900) -> None:
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, f"pip install {' '.join(args)} failed:\n{out.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A clean venv holding the wheel of this checkout and what it declares; its bin dir."""
    root = tmp_path_factory.mktemp("install")
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = env_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    if not place_pinned_torch(site):
        pip(python, torch_spec())
    (wheel,) = wheels.glob("bcastbench-*.whl")
    pip(python, str(wheel))
    return env_dir / "bin"


def place_pinned_torch(site: Path) -> bool:
    """Put this interpreter's torch distribution into ``site`` when it is the pinned one (the
    same files pip would unpack from the same pin, already byte-compiled): hard links, or
    copies across filesystems. pip then finds torch installed, as after ``pip install
    TORCH_SPEC``, and resolves torch's own dependencies with the product's. False, with nothing
    placed, when this interpreter's torch is not the pin."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return False
    if not Requirement(torch_spec()).specifier.contains(dist.version, prereleases=True):
        return False
    origin = Path(dist.locate_file(""))
    tops = {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}
    if not tops:  # no RECORD to say which files are torch's
        return False
    for top in sorted(tops):
        source = origin / top
        if source.is_dir():
            shutil.copytree(source, site / top, copy_function=_link_or_copy, symlinks=True)
        elif source.is_file():
            _link_or_copy(source, site / top)
    return True


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def run_in(cwd: Path, *argv, timeout: int = 600) -> subprocess.CompletedProcess:
    # pip was told not to byte-compile the venv (it would compile every file on one core):
    # the first command writes the bytecode of what it imports, and the next ones read it.
    drop = {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_wheel_ships_its_configuration(installed, tmp_path):
    out = run_in(
        tmp_path, installed / "python", "-c",
        "import harness, harness.paths as p; print(harness.__file__); print(p.CONF_DIR)",
    )  # fmt: skip
    module, conf = out.stdout.split()
    assert str(installed.parent) in module, "the checkout's copy was imported"
    assert (
        Path(conf, "config.yaml").is_file() and Path(conf, "schemas", "rl_rollout.yaml").is_file()
    )


def test_installed_run_report_and_plugin_work_from_any_directory(installed, tmp_path):
    out = run_in(tmp_path, installed / "bcastbench", "run", "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strategy" in out.stdout
    out = run_in(
        tmp_path, installed / "bcastbench", "strategy=header", "layout=tp2pp2",
        "payload.batch_size=2", "payload.seq_len=64", "iters=2", "warmup=1",
        "hydra.run.dir=run",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["correct"] and record["strategy"] == "header"
    out = run_in(tmp_path, installed / "bcastbench", "report", "run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "report.md").is_file()
    (tmp_path / "test_gate.py").write_text(GATE)
    out = run_in(
        tmp_path, installed / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "--bcastbench-mode=short", "test_gate.py",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
