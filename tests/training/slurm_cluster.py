"""A one-node SLURM cluster on this machine for ``test_slurm.py``: munged, slurmctld and slurmd in
the foreground under a temporary folder, with their own socket, ports, state and logs, so nothing
of the machine's own configuration (``/etc/slurm``, ``/run/munge``) is read or changed.

``ensure_installed`` installs Debian's ``slurm-wlm`` and ``munge`` with apt-get when they are
missing (root only; measured ~16 s from an up-to-date package list); it returns why not when
that cannot be done, for the test to skip with.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")
SBIN = ("/usr/sbin", "/sbin")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def ensure_installed() -> str | None:
    """None when SLURM and munge are there (installing them if need be), else the reason."""
    if all(_which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and cannot be (installing them needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    for attempt in (install, ["apt-get", "update", "-q"], install):
        res = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=300)
        if attempt is install and res.returncode == 0 and all(_which(b) for b in BINARIES):
            return None
    return f"apt-get could not install slurm-wlm and munge: {res.stderr.strip()[-400:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Start with ``start()``, stop with ``stop()``; ``run(cmd)`` runs a client command against it."""

    def __init__(self, root: Path, cpus: int):
        self.root, self.cpus = root, cpus
        self.host = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def _write_conf(self) -> None:
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
            "ClusterName=zerotron-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r / 'munge.socket'}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2", "SlurmdParameters=config_overrides", "MinJobAge=600",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))

    def start(self, timeout: float = 30.0) -> None:
        r = self.root
        r.chmod(0o700)  # munged refuses a key readable by others
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={r / 'munge.key'}"], check=True,
                       capture_output=True)
        self._write_conf()
        self._spawn([_which("munged"), "-F", "-f", f"--socket={r / 'munge.socket'}", f"--key-file={r / 'munge.key'}",
                     f"--log-file={r / 'munged.log'}", f"--pid-file={r / 'munged.pid'}",
                     f"--seed-file={r / 'munged.seed'}"], "munged")
        self._wait(lambda: (r / "munge.socket").exists(), timeout, "munged did not create its socket")
        self._spawn([_which("slurmctld"), "-D", "-i"], "slurmctld")
        self._spawn([_which("slurmd"), "-D", "-N", self.host], "slurmd")
        self._wait(lambda: self.run(["sinfo", "-h", "-o", "%T"]).stdout.strip() == "idle", timeout,
                   "the node did not become idle")

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / f"{name}.stdout", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        logs = {p.name: p.read_text()[-1500:] for p in self.root.glob("*.log")}
        logs.update({p.name: p.read_text()[-1500:] for p in self.root.glob("*.stdout")})
        raise RuntimeError(f"{what} within {timeout:.0f} s (exited: {dead}); logs: {logs}")

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]), *cmd[1:]], env={**self.env, **kw.pop("env", {})},
                              capture_output=True, text=True, timeout=60, **kw)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def stop(self) -> None:
        self.run(["scancel", "--full", "--signal=KILL", "--user=root"])
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged: each one we started, by pid
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
