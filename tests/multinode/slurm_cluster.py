"""A real Slurm on one host: slurmctld and one slurmd per network-namespace node (netns.two_nodes).

Debian's slurm-wlm (22.05) runs several slurmd on one machine when each sits in its own network
namespace: each has its own address and ports, `slurmd -N <node>` names it, and spool, pid and log
files carry %n. Authentication is auth/none (no munge daemon; nothing leaves the namespaces).
`unavailable()` says why a host cannot, for a visible skip.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


def unavailable() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"needs Slurm ({', '.join(missing)} missing): apt-get install slurm-wlm"
    return None


class Cluster:
    def __init__(self, nodes, workdir: Path):
        self.nodes, self.workdir = nodes, workdir
        self.conf = workdir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def run(self, *cmd: str, node: int = 0, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command, run on `node` (node 0 holds slurmctld)."""
        proc = subprocess.run([*self.nodes[node].prefix(), *cmd], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}\n{self.logs()}")
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.workdir.glob("*.log")))

    def job_state(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_state(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s:\n{info}\n{self.logs()}")
            time.sleep(1)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def slurm_cluster(nodes, workdir: Path, cpus: int | None = None):
    """slurmctld on node 0 and a slurmd on each node; stopped (by pid) on exit, also when the body raises."""
    workdir.mkdir(parents=True, exist_ok=True)
    cpus = cpus or os.cpu_count() or 2
    names = [f"n{i}" for i in range(len(nodes))]
    (workdir / "state").mkdir(exist_ok=True)
    for name in names:
        (workdir / f"spool-{name}").mkdir(exist_ok=True)
    node_lines = "\n".join(f"NodeName={name} NodeAddr={node.addr} CPUs={cpus} State=UNKNOWN" for name, node in zip(names, nodes))
    (workdir / "slurm.conf").write_text(f"""\
ClusterName=megarltest
SlurmctldHost={socket.gethostname()}({nodes[0].addr})
SlurmctldPort={_port()}
SlurmdPort={_port()}
AuthType=auth/none
AuthInfo=cred_expire=30
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool-%n
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd-%n.pid
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdLogFile={workdir}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=60
{node_lines}
PartitionName=test Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    (workdir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    cluster = Cluster(nodes, workdir)
    try:
        cluster.procs.append(subprocess.Popen([*nodes[0].prefix(), "slurmctld", "-D", "-i"], env=cluster.env,
                                              stdout=subprocess.DEVNULL, stderr=open(workdir / "slurmctld.stderr.log", "w")))
        time.sleep(1)
        for name, node in zip(names, nodes):
            # `ip netns exec` gives the daemon a private mount namespace with a fresh /sys: slurmd needs a
            # cgroup filesystem there, and mounting it there touches nothing outside.
            start = ("mkdir -p /sys/fs/cgroup && mount -t tmpfs cgroup_root /sys/fs/cgroup && "
                     "for c in freezer cpuset memory devices; do mkdir -p /sys/fs/cgroup/$c && "
                     "mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done && "
                     f"exec slurmd -D -N {name}")
            cluster.procs.append(subprocess.Popen([*node.prefix(), "bash", "-c", start], env=cluster.env,
                                                  stdout=subprocess.DEVNULL, stderr=open(workdir / f"slurmd-{name}.stderr.log", "w")))
        deadline = time.monotonic() + 60
        while True:
            out = cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            if out and all(s == "idle" for s in out) and len(out) >= 1:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.procs):
                raise RuntimeError(f"Slurm did not come up (sinfo: {out}):\n{cluster.logs()}")
            time.sleep(1)
        yield cluster
    finally:
        for proc in reversed(cluster.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in cluster.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
