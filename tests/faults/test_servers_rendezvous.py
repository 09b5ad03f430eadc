"""The trainers' rendezvous: every listening socket is on the configured address (MASTER_ADDR).

torch's TCPStore server listens on every interface whatever host it is given (checked below, so a
torch that changes this shows up); `aligner.runtime.distributed.initialize` hands it a socket bound
to MASTER_ADDR, and keeps gloo on loopback when MASTER_ADDR is loopback. Checked for a lone process
(the store on a free loopback port) and for a two-process job started without torchrun (as Slurm's
srun starts one: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on a loopback address other than the
default, with a collective across the two ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ..conftest import REPO_ROOT, free_port_block

WILDCARDS = {"0.0.0.0", "::"}

RANK_SCRIPT = """
import json, psutil, torch, torch.distributed as dist
from aligner.runtime import distributed
distributed.initialize(distributed.ParallelConfig())
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
listening = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                    if c.status == "LISTEN"})
print(json.dumps({"rank": dist.get_rank(), "sum": total.item(), "listening": listening}), flush=True)
dist.barrier()
distributed.shutdown()
"""


def run_ranks(world: int, env_extra: dict) -> list[dict]:
    env = {name: value for name, value in os.environ.items()
           if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME",
                           "TORCHELASTIC_USE_AGENT_STORE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    processes = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**env, **env_extra, **({"RANK": str(rank), "LOCAL_RANK": str(rank),
                                                               "WORLD_SIZE": str(world)} if world > 1 else {})})
                 for rank in range(world)]
    reports = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-4000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return sorted(reports, key=lambda report: report["rank"])


def test_torch_tcp_store_alone_listens_on_every_interface():
    """Why aligner binds the socket itself: given 127.0.0.1, torch's store still listens on '::'."""
    import datetime

    import psutil
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30))
    try:
        addresses = {c.laddr.ip for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
        assert addresses & WILDCARDS, addresses
    finally:
        del store


def test_lone_process_listens_on_loopback_only():
    (report,) = run_ranks(1, {})
    addresses = {address for address, _ in report["listening"]}
    print(f"\nlone process listening on {sorted(addresses)} ({len(report['listening'])} sockets)")
    assert report["sum"] == 1.0
    assert addresses == {"127.0.0.1"}, report["listening"]


def test_two_ranks_without_torchrun_listen_on_master_addr_only():
    master_addr, master_port = "127.0.0.3", free_port_block(1)
    reports = run_ranks(2, {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    assert [report["sum"] for report in reports] == [3.0, 3.0]
    assert [master_addr, master_port] in reports[0]["listening"]  # rank 0 hosts the store there
    for report in reports:
        addresses = {address for address, _ in report["listening"]}
        print(f"\nrank {report['rank']} listening on {sorted(addresses)}")
        assert not addresses & WILDCARDS, report["listening"]
        # gloo: on loopback (the interface holding 127.0.0.1) since MASTER_ADDR is a loopback address
        assert addresses <= {master_addr, "127.0.0.1"}, report["listening"]
