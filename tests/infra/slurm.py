"""A real single-node Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) started by tests,
installing the Debian packages if missing; all state in a temp dir, every daemon stopped by PID.

Ports are picked free on 127.0.0.1 (not 6817-6819), munge uses its own key and socket, and
MariaDB its own datadir, so nothing touches the packaged configs in /etc.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server")
POLICY_RC = Path("/usr/sbin/policy-rc.d")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not root, no apt, install failed); tests should skip."""


class SlurmStartError(RuntimeError):
    """The packages are there but a daemon did not come up: a real failure, not a skip."""


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class SlurmCluster:
    """A one-node Slurm cluster with accounting, for tests. Use as a context manager.

    While active, ``SLURM_CONF`` is set in ``os.environ`` so ``srun``/``sbatch``/``sacct`` and the
    Hydra submitit launcher find it; :attr:`env` holds the same for explicit subprocesses.
    """

    cpus: int = 8
    """CPUs declared for the node (more than the machine has, so 4-task jobs fit on 2 cores)."""
    partition: str = "bcb"
    """Name of the single (default) partition."""
    cluster_name: str = "bcastbench"
    """ClusterName in slurm.conf and in the accounting database."""
    kill_wait_s: int = 5
    """KillWait: seconds between SIGTERM and SIGKILL when a job is cancelled or fails."""
    start_timeout_s: float = 300.0
    """How long each daemon may take to become ready. slurmdbd creates its ~30 accounting tables
    on first start: seconds on a quiet machine, over a minute on a loaded CI runner."""
    keep_dir: bool = False
    """Keep the state directory (configs, logs, database) after stopping, for debugging."""

    root: Path = field(init=False, default=Path("/nonexistent"))
    """State directory (configs, logs, database, spool); set on entry."""
    nodename: str = field(init=False, default="")
    env: dict[str, str] = field(init=False, default_factory=dict)
    """Environment to give Slurm client commands (``SLURM_CONF``)."""
    pids: dict[str, int] = field(init=False, default_factory=dict)
    """PID of each running daemon, by name."""
    startup_s: float = field(init=False, default=0.0)
    """Seconds from starting munged to the node being idle."""

    def __post_init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}
        self._scratch: list[Path] = []  # directories outside root to remove on stop
        self._old_slurm_conf: str | None = None

    # -- public --------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    def run(self, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster (text output captured)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("check", False)
        kw.setdefault("env", {**os.environ, **self.env})
        return subprocess.run(argv, **kw)  # type: ignore[call-overload]

    def queue(self) -> list[str]:
        """Job ids still known to squeue (pending, running or completing)."""
        res = self.run(["squeue", "-h", "-o", "%i"])
        return res.stdout.split()

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait until squeue is empty and the node is idle again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.queue() and self.node_state() == "idle":
                return
            time.sleep(0.3)
        raise TimeoutError(f"Slurm not idle after {timeout} s: queue={self.queue()}")

    def node_state(self) -> str:
        res = self.run(["sinfo", "-h", "-N", "-n", self.nodename, "-o", "%t"])
        return res.stdout.strip()

    def log(self, daemon: str) -> str:
        path = self.root / "log" / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        if os.geteuid() != 0:
            raise SlurmUnavailable("a Slurm cluster for tests needs root")
        ensure_packages()
        self.root = Path(tempfile.mkdtemp(prefix="bcb-slurm-"))
        # munged runs as the munge user and must reach its own subdirectories.
        self.root.chmod(0o755)
        self.nodename = socket.gethostname().split(".")[0]
        self.env = {"SLURM_CONF": str(self.conf)}
        self._old_slurm_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        t0 = time.monotonic()
        for sub in ("etc", "log", "run", "state", "spool", "mysql"):
            (self.root / sub).mkdir()
        self._ports = {name: _free_port() for name in ("mysql", "slurmdbd", "slurmctld", "slurmd")}
        self._start_munge()
        self._start_mariadb()
        self._write_configs()
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait("slurmdbd", lambda: _port_open(self._ports["slurmdbd"]))
        # Register the cluster before slurmctld first talks to slurmdbd, so its jobs are
        # recorded from the very first one.
        res = self.run(["sacctmgr", "-i", "add", "cluster", self.cluster_name])
        if res.returncode != 0 and "already exists" not in res.stdout + res.stderr:
            raise SlurmStartError(f"sacctmgr add cluster failed: {res.stdout}{res.stderr}")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: _port_open(self._ports["slurmctld"]))
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        self._wait("slurmd", lambda: self.node_state() == "idle")
        self.startup_s = time.monotonic() - t0

    def _spawn(self, name: str, argv: list[str]) -> None:
        # Foreground daemons in their own session: the Popen PID is the daemon's PID, and
        # stop() signals exactly those PIDs.
        out = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        out.close()
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def _wait(self, name: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        proc = self._procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if ready():
                return
            time.sleep(0.1)
        out = (self.root / "log" / f"{name}.out").read_text(errors="replace")
        state = "exited" if proc.poll() is not None else "not ready"
        raise SlurmStartError(
            f"{name} {state} (rc={proc.poll()}):\n{out[-2000:]}\n{self.log(name)[-3000:]}"
        )

    def _start_munge(self) -> None:
        pw = pwd.getpwnam("munge")
        mdir, sdir = self.root / "munge", self.root / "munge-run"
        # munged insists: the key (and its seed/log) private to the munge user, the socket
        # directory executable by everyone (clients connect as any user).
        mdir.mkdir(mode=0o700)
        sdir.mkdir(mode=0o755)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for path in (mdir, sdir, key):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        self.munge_socket = sdir / "munge.socket"
        # setpriv execs in place (runuser would fork), so the PID stays the daemon's.
        self._spawn(
            "munged",
            ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]
            + ["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}"]
            + [f"--pid-file={sdir / 'munged.pid'}", f"--log-file={mdir / 'munged.log'}"]
            + [f"--seed-file={mdir / 'munged.seed'}"],
        )
        self._wait("munged", self.munge_socket.exists)

    def _start_mariadb(self) -> None:
        sock = self.root / "run" / "mysqld.sock"
        # The database lives in memory where it can: a throw-away database needs no durability,
        # and on a loaded disk InnoDB's fsyncs made slurmdbd's table creation crawl.
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.root
        _remove_orphans(base)
        # The owner's pid in the name: a session killed before its teardown leaves the
        # directory behind, and the next cluster started here removes it.
        data = Path(tempfile.mkdtemp(prefix=f"bcb-mysql-{os.getpid()}-", dir=base))
        self._scratch.append(data)
        common = ["--no-defaults", f"--datadir={data}", "--user=root"]
        res = subprocess.run(
            ["mariadb-install-db", *common, "--auth-root-authentication-method=normal"]
            + ["--skip-test-db", "--skip-name-resolve"],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise SlurmStartError(f"mariadb-install-db failed:\n{res.stdout}\n{res.stderr}")
        self._spawn(
            "mariadbd",
            ["mariadbd", *common, f"--socket={sock}", f"--port={self._ports['mysql']}"]
            + ["--bind-address=127.0.0.1", f"--pid-file={self.root / 'run' / 'mariadbd.pid'}"]
            + [f"--log-error={self.root / 'log' / 'mariadbd.log'}", "--skip-name-resolve"]
            + ["--skip-log-bin", "--innodb-buffer-pool-size=64M"]
            + ["--innodb-flush-log-at-trx-commit=0", "--innodb-log-file-size=16M"]
            + ["--innodb-doublewrite=0"],
        )
        self._wait("mariadbd", lambda: _port_open(self._ports["mysql"]))
        sql = (
            "CREATE USER 'slurm'@'127.0.0.1';"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
            "FLUSH PRIVILEGES;"
        )
        res = subprocess.run(
            ["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", sql],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise SlurmStartError(f"creating the slurm database user failed: {res.stderr}")

    def _write_configs(self) -> None:
        r, p = self.root, self._ports
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        dbd = self.root / "etc" / "slurmdbd.conf"
        dbd.write_text(
            auth
            + f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={p['slurmdbd']}\nSlurmUser=root\n"
            + f"LogFile={r / 'log' / 'slurmdbd.log'}\nPidFile={r / 'run' / 'slurmdbd.pid'}\n"
            + "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            + f"StoragePort={p['mysql']}\nStorageUser=slurm\nStorageLoc=slurm_acct_db\n"
        )
        dbd.chmod(0o600)  # slurmdbd refuses a config that others can read
        real_mem = self._real_memory()
        self.conf.write_text(
            f"ClusterName={self.cluster_name}\n"
            f"SlurmctldHost={self.nodename}(127.0.0.1)\n"
            f"SlurmctldPort={p['slurmctld']}\nSlurmdPort={p['slurmd']}\n"
            + auth
            + "CredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\n"
            f"StateSaveLocation={r / 'state'}\nSlurmdSpoolDir={r / 'spool'}\n"
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}\n"
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}\n"
            # No systemd, no cgroups: track processes by parentage and bind nothing.
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\n"
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=127.0.0.1\nAccountingStoragePort={p['slurmdbd']}\n"
            # AuthInfo does not cover the slurmdbd connection; with munge this names its socket.
            f"AccountingStoragePass={self.munge_socket}\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "SchedulerType=sched/backfill\nMpiDefault=none\nMailProg=/bin/true\n"
            "ReturnToService=2\nSlurmdParameters=config_overrides\n"
            f"KillWait={self.kill_wait_s}\nInactiveLimit=0\nMinJobAge=300\n"
            "SlurmctldDebug=info\nSlurmdDebug=info\n"
            f"NodeName={self.nodename} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={real_mem} State=UNKNOWN\n"
            f"PartitionName={self.partition} Nodes={self.nodename} Default=YES "
            "MaxTime=INFINITE State=UP OverSubscribe=FORCE\n"
        )

    @staticmethod
    def _real_memory() -> int:
        res = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=False)
        for tok in res.stdout.split():
            if tok.startswith("RealMemory="):
                return int(tok.split("=", 1)[1])
        return 1024

    def stop(self) -> None:
        """Cancel jobs, stop every daemon by its PID (newest first), restore SLURM_CONF."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--quiet", f"--partition={self.partition}"])
            try:
                deadline = time.monotonic() + 2 * self.kill_wait_s + 10
                while self.queue() and time.monotonic() < deadline:
                    time.sleep(0.3)
            except OSError:
                pass
        for name in reversed(list(self._procs)):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self._procs.clear()
        if self._old_slurm_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_slurm_conf
        if self.root.name.startswith("bcb-slurm-") and not self.keep_dir:
            shutil.rmtree(self.root, ignore_errors=True)
            for path in self._scratch:
                shutil.rmtree(path, ignore_errors=True)


def _remove_orphans(base: Path) -> None:
    """Remove the database directories in ``base`` whose owning test process is gone."""
    for path in base.glob("bcb-mysql-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
