"""A real single-node Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) started by tests.

Installs the Debian packages if missing, keeps all state in a temp dir, stops every daemon by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server")
POLICY_RC = Path("/usr/sbin/policy-rc.d")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not root, no apt, install failed); tests should skip."""


def _installed(pkg: str) -> bool:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, check=False
    )
    return out.returncode == 0 and out.stdout.strip() == "install ok installed"


def missing_packages() -> list[str]:
    if shutil.which("dpkg-query") is None:
        return list(PACKAGES)
    return [p for p in PACKAGES if not _installed(p)]


def ensure_packages(timeout: float = 600) -> None:
    """Install the Slurm/munge/MariaDB packages unless they are there already."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"not root; cannot install {missing}")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"no apt-get; cannot install {missing}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Post-install scripts would start the daemons with the packaged configs; policy-rc.d
    # exiting 101 makes invoke-rc.d refuse, so only our own foreground daemons ever run.
    created_policy = not POLICY_RC.exists()
    if created_policy:
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        for argv in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        ):
            res = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
            if res.returncode != 0:
                raise SlurmUnavailable(
                    f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout[-2000:]}"
                    f"\n{res.stderr[-2000:]}"
                )
    finally:
        if created_policy:
            POLICY_RC.unlink(missing_ok=True)
    still = missing_packages()
    if still:
        raise SlurmUnavailable(f"packages still missing after apt-get install: {still}")
