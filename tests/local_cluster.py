"""A one-node SLURM cluster on loopback, for trying the launch scripts and for CI.

    python -m tests.local_cluster up [--dir DIR]    # start; prints `export SLURM_CONF=...`
    python -m tests.local_cluster down [--dir DIR]  # cancel jobs, stop the daemons it started

Needs Debian's ``slurmctld slurmd slurm-client munge`` (``install()`` runs apt-get for them) and root.
Nothing goes to ``/etc``: ``slurm.conf``, spool dirs, logs and PID files live in one directory, and the
client commands find it through ``SLURM_CONF``. The cluster has its own munge daemon on a private
socket and its own controller/node ports, so two clusters (two pytest workers) do not meet, and a
system-wide munge or slurm is never touched. Give concurrent clusters distinct ``first_job_id`` blocks: the
launch scripts derive the rendezvous port from the job id (train.sbatch: 20000 + id % 20000; submitit
seeds its port choice with it), so two clusters that both number from 1 start two jobs on one port.
``stop()`` cancels the cluster's jobs, kills processes still running under its ``SLURM_CONF`` and then
each daemon by the PID it recorded, escalating to SIGKILL; daemons started by ``start()`` also get SIGTERM
if the starting process dies (PDEATHSIG). ``KillWait=30`` (SLURM's default): after the SIGTERM of a cancel or
time limit the trainer has 30 s to save before SIGKILL, as on most clusters.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch", "/usr/bin/srun")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}

SLURM_CONF = """\
ClusterName={name}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
FirstJobId={first_job_id}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
StateSaveLocation={dir}/spool/ctld
SlurmdSpoolDir={dir}/spool/d
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MinJobAge=600
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(RuntimeError):
    pass


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if not os.path.exists(b)]


def install() -> None:
    """apt-get install the Debian packages (root). Raises ClusterError with apt's output on failure."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this daemon if the process that started it dies (runs after setuid)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 * 9 // 10
    return 4000


class LocalCluster:
    """``with LocalCluster(dir) as c: job = c.sbatch([...]); c.wait(job)``; see the module docstring."""

    def __init__(self, root: str | Path, cpus: int | None = None, name: str = "dsv3ci", first_job_id: int = 1):
        if not 1 <= first_job_id < 67_000_000:   # SLURM's default MaxJobId is 67043328
            raise ValueError(f"first_job_id={first_job_id}: must be in [1, 67000000)")
        self.dir = Path(root).resolve()
        self.first_job_id = first_job_id
        self.cpus = cpus or os.cpu_count() or 1
        self.name = name
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.munge_dir: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, squeue, ...): the process env plus SLURM_CONF."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ---- start / stop --------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> "LocalCluster":
        if os.geteuid() != 0:
            raise ClusterError("a local SLURM cluster needs root (slurmd runs jobs as the submitting user)")
        if missing_binaries():
            raise ClusterError(f"missing {missing_binaries()}; install {' '.join(PACKAGES)} (apt-get)")
        (self.dir / "spool/ctld").mkdir(parents=True, exist_ok=True)
        (self.dir / "spool/d").mkdir(parents=True, exist_ok=True)
        # munged refuses group/world-writable dirs and runs as the munge user, who cannot enter pytest's
        # private tmp dirs: its socket, seed, log and PID file get a fresh dir of their own.
        munge = pwd.getpwnam("munge")
        self.munge_dir = Path(tempfile.mkdtemp(prefix="dsv3-munge-"))
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        os.chmod(self.munge_dir, 0o755)
        sock = self.munge_dir / "munge.socket"
        self.conf.write_text(SLURM_CONF.format(
            name=self.name, dir=self.dir, ctld_port=_free_port(), slurmd_port=_free_port(), munge_socket=sock,
            first_job_id=self.first_job_id, cpus=self.cpus, mem_mb=_mem_mb()))
        self._record()
        try:
            self._spawn("munged", ["/usr/sbin/munged", "-F", f"--socket={sock}", "--key-file=/etc/munge/munge.key",
                                   f"--seed-file={self.munge_dir}/seed", f"--log-file={self.munge_dir}/munged.log",
                                   f"--pid-file={self.munge_dir}/munged.pid"], user="munge")
            self._wait_for(lambda: sock.exists(), timeout_s, "munged socket", "munged")
            self._spawn("slurmctld", ["/usr/sbin/slurmctld", "-D", "-c", "-f", str(self.conf)])
            self._wait_for(lambda: self._run(["scontrol", "ping"]).returncode == 0, timeout_s,
                           "slurmctld to answer", "slurmctld")
            self._spawn("slurmd", ["/usr/sbin/slurmd", "-D", "-f", str(self.conf), "-N", "localhost"])
            self._wait_for(lambda: self._run(["sinfo", "-h", "-o", "%T"]).stdout.strip() == "idle", timeout_s,
                           "the node to be idle", "slurmd")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, cmd: list[str], user: str | None = None) -> None:
        log = open(self.dir / f"{name}.stdout", "w")
        # The daemons read their config from -f; without SLURM_CONF in their environment, the scan for
        # leftover job processes in stop() cannot mistake slurmscriptd or slurmstepd for one.
        env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, user=user, preexec_fn=_die_with_parent)
        log.close()
        self._record()

    def _record(self) -> None:
        """PIDs on disk, so ``down`` from another process stops exactly these daemons."""
        state = {"owner": os.getpid(), "pids": {n: p.pid for n, p in self.procs.items()},
                 "munge_dir": str(self.munge_dir or "")}
        (self.dir / "cluster.json").write_text(json.dumps(state))

    def _wait_for(self, ok, timeout_s: float, what: str, daemon: str) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            p = self.procs.get(daemon)
            if p is not None and p.poll() is not None:
                raise ClusterError(f"{daemon} exited ({p.returncode}) while waiting for {what}:\n{self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{self.logs()}")

    def stop(self, grace_s: float = 10) -> None:
        """Cancel all jobs, end their leftover processes, then the daemons (by PID); idempotent."""
        pids = {n: p.pid for n, p in self.procs.items() if p.poll() is None}
        if not pids and (self.dir / "cluster.json").exists():   # `down` from another process
            state = json.loads((self.dir / "cluster.json").read_text())
            owner = state.get("owner")
            if owner and owner != os.getpid() and state["pids"] and b"local_cluster" in _cmdline(owner):
                _kill(owner, grace_s + 5)   # `up` stops its cluster itself on SIGTERM
            pids = {n: pid for n, pid in state["pids"].items() if n.encode() in _cmdline(pid)}  # not recycled
            self.munge_dir = Path(state["munge_dir"]) if state["munge_dir"] else None
        if "slurmctld" in pids:
            self._run(["scancel", "--full", "--user=root"], timeout=10)
            end = time.monotonic() + grace_s
            while time.monotonic() < end and self._run(["squeue", "-h"], timeout=10).stdout.strip():
                time.sleep(0.3)
        for pid in self._job_processes():
            _kill(pid, grace_s=2)
        for name in ("slurmd", "slurmctld", "munged"):
            if name in pids:
                _kill(pids[name], grace_s, self.procs.get(name))
        self.procs.clear()
        self._record()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None

    def _job_processes(self) -> list[int]:
        """Processes (job scripts, slurmstepd, training ranks) running with this cluster's SLURM_CONF."""
        mark = f"SLURM_CONF={self.conf}".encode()
        own = {os.getpid(), *(p.pid for p in self.procs.values())}
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) not in own:
                try:
                    if mark in (d / "environ").read_bytes().split(b"\0"):
                        found.append(int(d.name))
                except OSError:
                    pass
        return found

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- jobs ----------------------------------------------------------------------------------
    def _run(self, cmd: list[str], timeout: float = 30, env: dict | None = None,
             cwd=None) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})},
                              cwd=cwd)

    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> int:
        """Submit; returns the job id. ``env`` is added to the submitting environment (sbatch exports it)."""
        r = self._run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        if r.returncode:
            raise ClusterError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, NumTasks, ...); {} if unknown."""
        r = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        info = {}
        for field in r.stdout.split():
            key, _, value = field.partition("=")
            info.setdefault(key, value)
        return info

    def wait(self, job_id: int, timeout_s: float = 300) -> dict[str, str]:
        """Poll until the job reaches a terminal state; returns its ``job_info``."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(0.5)
        raise ClusterError(f"job {job_id} not finished after {timeout_s:.0f}s: {self.job_info(job_id)}")

    def requeue(self, job_id: int, timeout_s: float = 60) -> None:
        """``scontrol requeue`` (what preemption does), then ``wait_restarted``."""
        r = self._run(["scontrol", "requeue", str(job_id)])
        if r.returncode:
            raise ClusterError(f"scontrol requeue {job_id} failed: {r.stderr.strip()}")
        self.wait_restarted(job_id, timeout_s)

    def signal_batch(self, job_id: int, sig: str = "USR1") -> None:
        """Send ``sig`` to the job's batch script only, as ``#SBATCH --signal=B:USR1@...`` does near the time limit."""
        r = self._run(["scancel", "--batch", f"--signal={sig}", str(job_id)])
        if r.returncode:
            raise ClusterError(f"scancel --batch --signal={sig} {job_id} failed: {r.stderr.strip()}")

    def signal_steps(self, job_id: int, sig: str = "USR1") -> None:
        """Send ``sig`` to every process of the job's steps (not the batch script), as ``#SBATCH
        --signal=USR1@<s>`` does <s> seconds before the time limit."""
        r = self._run(["scancel", f"--signal={sig}", str(job_id)])
        if r.returncode:
            raise ClusterError(f"scancel --signal={sig} {job_id} failed: {r.stderr.strip()}")

    def wait_restarted(self, job_id: int, timeout_s: float = 60) -> None:
        """Wait until a requeued job runs again, making it eligible early.

        SLURM holds a requeued job back (Reason=BeginTime) for the job-credential lifetime (``AuthInfo``
        ``cred_expire``, 120 s) because slurmd revoked the job's credential when it killed the first run and
        refuses any credential of that job created in the same second or earlier (whole seconds:
        ``ctime <= revoked``). Releasing it with ``StartTime=now`` in the second of the requeue therefore
        got the restart killed as "non-startable batch job: Job credential revoked" whenever the scheduler
        placed it before that second ended. So the release waits for the next second after the job is seen
        pending (the revocation came before that), which makes the new credential strictly newer."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            info = self.job_info(job_id)
            if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                time.sleep(max(0.0, math.floor(time.time()) + 1.05 - time.time()))
                self._run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
            elif info.get("JobState") not in ("COMPLETING", "REQUEUED", "PENDING", None) \
                    and info.get("Restarts", "0") != "0":
                return
            time.sleep(0.3)
        raise ClusterError(f"requeued job {job_id} did not start again within {timeout_s:.0f}s: "
                           f"{self.job_info(job_id)}")

    def logs(self, tail: int = 20) -> str:
        out = []
        for f in ("slurmctld.log", "slurmd.log", "munged.stdout", "slurmctld.stdout", "slurmd.stdout"):
            p = self.dir / f
            if p.exists():
                out.append(f"--- {f}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-tail:]))
        return "\n".join(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _kill(pid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL; reaps our own children."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                return
            if proc is None and not _alive(pid):
                return
            time.sleep(0.1)
    if proc is not None:
        proc.wait(timeout=5)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.local_cluster", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("up", "down", "install"))
    ap.add_argument("--dir", default="/tmp/dsv3-slurm", help="config, spool and logs (default %(default)s)")
    a = ap.parse_args(argv)
    if a.action == "install":
        install()
        return 0
    cluster = LocalCluster(a.dir)
    if a.action == "down":
        cluster.stop()
        print(f"stopped the cluster in {a.dir}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # `down` from another shell: stop cleanly
    cluster.start()
    # Keep the daemons when this process exits: they were started with PDEATHSIG, so we wait here.
    print(f"cluster up; in another shell: export SLURM_CONF={cluster.conf}\n"
          f"stop with Ctrl-C or `python -m tests.local_cluster down --dir {a.dir}`", flush=True)
    try:
        while all(p.poll() is None for p in cluster.procs.values()):
            time.sleep(1)
        print("a daemon exited:\n" + cluster.logs(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
