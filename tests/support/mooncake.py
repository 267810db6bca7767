"""A Mooncake store on loopback: a ``mooncake_master`` and a separate ``mooncake_client`` holder process.

The holder owns the memory segment, so objects survive a client's ``close`` and every transfer crosses TCP, as
between hosts. The client is set up only after the master's ``/health`` answers and the holder's segment shows
in the master's metrics (``setup`` against a missing master blocks for ~90 s).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lmcache_r3.launch import LOOPBACK, ManagedProcess, executable, free_port, start_on_fresh_ports

MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": LOOPBACK, "MC_LOG_LEVEL": "ERROR"}


@dataclass
class MooncakeCluster:
    master: ManagedProcess
    holder: ManagedProcess
    rpc_port: int
    metrics_port: int

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    def healthy(self) -> bool:
        url = f"http://{LOOPBACK}:{self.metrics_port}/health"
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200

    def capacity_bytes(self) -> float:
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            body = resp.read().decode()
        for line in body.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return float(line.split()[1])
        return 0.0

    def client(self, local_buffer_bytes: int = 64 << 20):
        """A ``MooncakeDistributedStore`` that contributes no memory of its own (``global_segment_size=0``)."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        code = store.setup(LOOPBACK, "P2PHANDSHAKE", 0, local_buffer_bytes, "tcp", "", self.master_address)
        if code != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup against {self.master_address} returned {code}")
        return store

    def stop(self) -> None:
        self.holder.stop(timeout_s=10)
        self.master.stop(timeout_s=10)


def start_mooncake(
    workdir: Path, segment: str = "256MB", ready_timeout_s: float = 30.0, lease_ms: int | None = 200
) -> MooncakeCluster:
    """A master and a separate holder on loopback. ``lease_ms``: the master's read lease (short, so tests can remove
    objects right after reading them); None keeps Mooncake's default (10 s), which large reads on a loaded machine
    need. Started again on new ports when another process took one of them first."""
    return start_on_fresh_ports(lambda: _start_mooncake_once(workdir, segment, ready_timeout_s, lease_ms))


def _start_mooncake_once(workdir: Path, segment: str, ready_timeout_s: float, lease_ms: int | None) -> MooncakeCluster:
    rpc_port, metrics_port, holder_port = free_port(), free_port(), free_port()
    master = ManagedProcess(
        "mooncake_master",
        [
            executable("mooncake_master"),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={metrics_port}",
            "--rpc_thread_num=2",
            *([f"--default_kv_lease_ttl={lease_ms}"] if lease_ms is not None else []),
            "--logtostderr=1",
        ],
        workdir / "mooncake-master.log",
        env=MOONCAKE_ENV,
        listens=((LOOPBACK, rpc_port), (LOOPBACK, metrics_port)),
    )
    holder = None
    try:
        cluster_probe = MooncakeCluster(master, master, rpc_port, metrics_port)
        master.wait_ready(cluster_probe.healthy, ready_timeout_s, "answering /health")
        holder = ManagedProcess(
            "mooncake_client (holder)",
            [
                executable("mooncake_client"),
                f"--host={LOOPBACK}",
                f"--port={holder_port}",
                f"--global_segment_size={segment}",
                "--local_buffer_size=0",
                f"--master_server_address={LOOPBACK}:{rpc_port}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
                "--logtostderr=1",
            ],
            workdir / "mooncake-holder.log",
            env=MOONCAKE_ENV,
            listens=((LOOPBACK, holder_port),),
        )
        holder.wait_ready(lambda: cluster_probe.capacity_bytes() > 0, ready_timeout_s, "segment mounted")
    except BaseException:
        if holder is not None:
            holder.stop()
        master.stop()
        raise
    return MooncakeCluster(master, holder, rpc_port, metrics_port)
