"""A real Slurm cluster of three nodes on one machine, for the cluster test tier and for trying the project's Slurm
scripts before a real cluster (docs/guides/slurm.md).

Each node is a network namespace with its own address on a private bridge, its own hostname (a UTS namespace) and
its own `slurmd`; the controller (`slurmctld`, `munged`) runs in a namespace of its own that also holds the bridge.
Nothing is added to the machine's own network namespace: every address is on a link this script created inside a
namespace it created, so no traffic leaves them. The nodes share the machine's filesystem (the repository, the
virtual environment), as a cluster's nodes share a network filesystem, and its CPUs: each node declares the
machine's cores (they are not partitioned between nodes) and 30 % of its memory.

    python tests/cluster/minicluster.py up      # start it (installs slurm-wlm and munge with apt-get if missing)
    python tests/cluster/minicluster.py shell   # a shell on the controller: sinfo, sbatch, squeue, scancel ...
    python tests/cluster/minicluster.py down    # stop every process, remove the namespaces, links and files

Needs root (network namespaces) and Debian's slurm-wlm 22.05 and munge.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "alnc"                 # namespace names: alnc-ctl, alnc-n1, ... (a cluster of its own: another prefix)
SUBNET = "10.213.77"            # a private test range; .1 the controller, .11, .12, ... the nodes
ROOT = Path("/tmp/aligner-minicluster")
CLUSTER = "aligner-mini"
APT_PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the mini cluster (not root, no namespaces, packages missing)."""


def _run(*cmd: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}: {(result.stderr or result.stdout).strip()}")
    return result


def _installed(program: str) -> bool:
    return shutil.which(program) is not None or Path("/usr/sbin", program).exists()  # sbin: not on every PATH


def install_packages() -> None:
    """apt-get install what is missing (the project's set-up step for the cluster tier; `make cluster-deps`)."""
    missing = [name for name in ("slurmd", "slurmctld", "sbatch", "munged") if not _installed(name)]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"{', '.join(missing)} missing and no root apt-get to install "
                                 f"{' '.join(APT_PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ("apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES)
    if subprocess.run(install, capture_output=True, env=env, timeout=900).returncode != 0:
        _run("apt-get", "update", "-q", timeout=600, env=env)
        _run(*install, timeout=900, env=env)


def unavailable_reason() -> str | None:
    """Why this machine cannot host the cluster, or None (checked without changing anything)."""
    if sys.platform != "linux":
        return "Linux network namespaces are needed"
    if os.geteuid() != 0:
        return "root is needed to create network namespaces"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    if shutil.which("apt-get") is None and not _installed("slurmctld"):
        return "slurm-wlm is not installed and there is no apt-get to install it"
    probe = f"{PREFIX}-probe"
    made = subprocess.run(("ip", "netns", "add", probe), capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(("ip", "netns", "del", probe), capture_output=True)
    return None


class MiniCluster:
    """Three Slurm nodes (n1, n2, n3) and a controller (ctl) in network namespaces on one bridge.

    `up()` starts it and waits until `sinfo` shows every node idle; `down()` removes everything it made, and is
    safe to call twice or after a failed `up()`. `run()` runs a client command (sbatch, squeue, scontrol, ...) on
    the controller's namespace with the cluster's configuration."""

    def __init__(self, nodes: int = 3, root: Path = ROOT, memory_mb: int | None = None, slurmd_timeout_s: int = 10,
                 prefix: str = PREFIX):
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.prefix = prefix  # of its namespaces' names: two clusters with other prefixes (and roots) coexist
        self.root = Path(root)
        self.conf = self.root / "etc" / "slurm.conf"
        self.hosts = self.root / "etc" / "hosts"  # the nodes' /etc/hosts: names of the nodes and the controller
        total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        self.memory_mb = memory_mb or int(total_mb * 0.9) // nodes  # a share each; 10 % left to the machine
        self.cpus = os.cpu_count() or 1
        self.slurmd_timeout_s = slurmd_timeout_s

    # -- names and addresses ------------------------------------------------------------------------------------
    def namespace(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def address(self, node: str) -> str:
        return f"{SUBNET}.1" if node == "ctl" else f"{SUBNET}.{10 + int(node[1:])}"

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(name) for name in ["ctl", *self.names]]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a client or job submission needs: the configuration, the venv first on PATH."""
        env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
        env.update(extra)
        return env

    # -- start and stop -----------------------------------------------------------------------------------------
    def up(self, timeout_s: float = 90) -> MiniCluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        install_packages()
        self.down()  # what a killed earlier run left
        try:
            self._network()
            self._files()
            self._daemons()
            self.wait_idle(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _network(self) -> None:
        ctl = self.namespace("ctl")
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ctl, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ctl, "addr", "add", f"{self.address('ctl')}/24", "dev", "br0")
        _run("ip", "-n", ctl, "link", "set", "br0", "up")
        for node in self.names:
            ns = self.namespace(node)
            # the pair is made inside the controller's namespace, its far end moved into the node's: the machine's
            # own namespace never holds either end
            _run("ip", "-n", ctl, "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", ctl, "link", "set", f"v{node}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def _files(self) -> None:
        for sub in ("etc", "state", "spool", "run", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.names:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{self.address(n)} {n}\n"
                                                             for n in ["ctl", *self.names]))
        r = self.root
        nodes = "".join(f"NodeName={n} NodeAddr={self.address(n)} CPUs={self.cpus} RealMemory={self.memory_mb} "
                        f"State=UNKNOWN\n" for n in self.names)
        self.conf.write_text(f"""# written by tests/cluster/minicluster.py
ClusterName={CLUSTER}
SlurmctldHost=ctl({self.address('ctl')})
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
# cred_expire: also how long a requeued job waits before it may start again (Slurm's default: 120 s)
AuthInfo=socket={r}/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
# no cgroups: the nodes share one machine's cgroup tree; processes are tracked by their parents
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
JobRequeue=1
# a node silent this long is DOWN and its jobs end (a real cluster's default is 300 s)
SlurmdTimeout={self.slurmd_timeout_s}
SlurmctldTimeout=30
MessageTimeout=10
KillWait=15
InactiveLimit=0
MinJobAge=300
{nodes}PartitionName=main Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")

    def _daemons(self) -> None:
        r = self.root
        _run(*self.on("ctl"), "munged", "--force", f"--socket={r}/munge/munge.socket",
             f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
             f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munged.seed")
        _run(*self.on("ctl"), "slurmctld", "-c", "-f", str(self.conf), env=self.env())
        for node in self.names:
            self.start_slurmd(node)

    def start_slurmd(self, node: str) -> None:
        """Start the node's slurmd (again, after `kill_node`) with the node's hostname."""
        _run(*self.on(node), "slurmd", "-f", str(self.conf), "-N", node, env=self.env())

    def on(self, node: str) -> list[str]:
        """The command prefix that runs a command on `node` ("ctl" or "n1", ...): in its network namespace, with
        its hostname (a UTS namespace) and its /etc/hosts (a bind mount in a mount namespace of its own; the rest
        of the filesystem, /sys/fs/cgroup included, is the machine's: `ip netns exec` would remount /sys and
        hide the cgroup tree slurmd reads)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}", "unshare", "--mount", "--uts", "sh", "-c",
                f'mount --bind "{self.hosts}" /etc/hosts && hostname {node} && exec "$@"', "sh"]

    def wait_idle(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if states and all(state == "idle" for state in states.values()) and set(states) == set(self.names):
                return
            time.sleep(0.5)
        log = (self.root / "log" / "slurmctld.log")
        tail = log.read_text().splitlines()[-5:] if log.exists() else []
        raise RuntimeError(f"the mini cluster's nodes are not idle after {timeout_s:.0f} s: {states}; "
                           f"slurmctld.log: {' | '.join(tail)}")

    def node_states(self) -> dict[str, str]:
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        states = {}
        for line in result.stdout.splitlines():
            name, state = line.split()
            states[name] = state.rstrip("*~#!%$@^-")
        return states

    def down(self) -> None:
        """Stop every process in the cluster's namespaces, remove the namespaces (and with them the links), the
        hosts files and the working files. Safe to call when nothing is up."""
        existing = set(_run("ip", "netns", "list", check=False).stdout.split())
        for ns in self.namespaces:
            if ns in existing:
                self._kill_all(ns)
                _run("ip", "netns", "del", ns, check=False)
        for pid in self._processes_using_conf():  # a daemon that left its namespace (none should)
            _kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_all(self, ns: str, grace_s: float = 5) -> None:
        pids = self.pids(ns)
        for pid in pids:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.pids(ns):
            _kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while self.pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)

    @staticmethod
    def pids(ns: str) -> list[int]:
        """The live processes in namespace `ns` (zombies awaiting their parent do not count)."""
        result = _run("ip", "netns", "pids", ns, check=False)
        return [int(pid) for pid in result.stdout.split() if _alive(int(pid))]

    def _processes_using_conf(self) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if str(self.conf).encode() in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    pass
        return found

    def leftovers(self) -> list[str]:
        """What of the cluster still exists (empty after `down()`): namespaces, processes, files."""
        left = [f"namespace {ns}" for ns in _run("ip", "netns", "list", check=False).stdout.split()
                if ns.startswith(self.prefix + "-")]
        left += [f"process {pid}" for pid in self._processes_using_conf()]
        left += [f"file {path}" for path in (self.root,) if path.exists()]
        return left

    # -- using it -----------------------------------------------------------------------------------------------
    def run(self, *cmd: str, node: str = "ctl", check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run `cmd` in a node's namespace (the controller's by default: the Slurm clients)."""
        return _run(*self.on(node), *cmd, check=check, timeout=timeout, env=env or self.env())

    def popen(self, node: str, *cmd: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `cmd` on `node` (outside Slurm: what a launcher such as torchrun on each node is)."""
        return subprocess.Popen([*self.on(node), *cmd], env=env or self.env(), **kwargs)

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        result = _run(*self.on("ctl"), "sbatch", "--parsable", *args,
                      env=env or self.env(), cwd=cwd)
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (of a het job: its first component), {} once the job is forgotten."""
        result = self.run("scontrol", "--oneliner", "show", "job", str(job_id), check=False)
        line = result.stdout.splitlines()[0] if result.stdout.strip() else ""
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_job(self, job_id: int, timeout_s: float, states: tuple[str, ...] = (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> dict:
        """Wait until the job is in one of `states`; returns its record (JobState, ExitCode, NodeList, ...)."""
        deadline = time.monotonic() + timeout_s
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") in states:
                return record
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s:.0f} s: {record.get('JobState')}")

    def hostnames(self, node_list: str) -> list[str]:
        """`scontrol show hostnames`: "n[1,3]" -> ["n1", "n3"]."""
        return self.run("scontrol", "show", "hostnames", node_list).stdout.split()

    def kill_node(self, node: str) -> None:
        """The node fails: its slurmd and every process on it are killed at once (SIGKILL)."""
        for pid in self.pids(self.namespace(node)):
            _kill(pid, signal.SIGKILL)

    def cut_link(self, node: str) -> None:
        """The node's network link goes down: its processes live on but reach no one."""
        _run("ip", "-n", self.namespace("ctl"), "link", "set", f"v{node}", "down")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "shell"])
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args(argv)
    cluster = MiniCluster(nodes=args.nodes)
    try:
        if args.command == "up":
            cluster.up()
            print(f"mini cluster up: nodes {', '.join(cluster.names)} idle; clients: "
                  f"python {sys.argv[0]} shell")
        elif args.command == "down":
            cluster.down()
            print("mini cluster down: no namespace, process or file left" if not cluster.leftovers()
                  else f"left: {cluster.leftovers()}")
        elif args.command == "status":
            print(json.dumps({"nodes": cluster.node_states() if cluster.conf.exists() else {},
                              "leftovers": cluster.leftovers()}, indent=1))
        else:
            prefix = cluster.on("ctl")
            os.execvpe(prefix[0], [*prefix, os.environ.get("SHELL", "bash")], cluster.env())
    except ClusterUnavailable as error:
        print(f"minicluster: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
