"""A stock ``lmcache server`` (LMCache 0.5.6 multiprocess mode) run as a local managed process.

The server is configured by command-line flags only. :func:`server_argv` builds that command line from typed
settings, :func:`start_server` runs it on loopback with telemetry off and returns once the server answers an RPC
``ping`` and its HTTP ``/status``. Everything lmcache_r3 starts (the demo, the tests) goes through here.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_r3.config import load_config
from lmcache_r3.launch import LOOPBACK, ManagedProcess, executable, free_port, start_on_fresh_ports
from lmcache_r3.tiers.plugins import l2_adapter_spec

#: Where LMCache finds the R3 chunk type (``--server-module``).
R3_SERVER_MODULE = "lmcache_r3.mp.server_module"


@dataclass(frozen=True)
class ServerSettings:
    """Flags of one ``lmcache server`` process."""

    port: int
    """ZMQ request port (the vLLM connector's ``lmcache.mp.port``)."""
    http_port: int
    """HTTP port of ``/status``, ``/cache/clear`` and the metrics API."""
    host: str = LOOPBACK
    """Address the request port binds to."""
    http_host: str = LOOPBACK
    """Address the HTTP port binds to (its API has no authentication)."""
    chunk_size: int = 256
    """Tokens per LMCache chunk; a multiple of the engine's block size."""
    l1_size_gb: float = 0.5
    eviction_policy: str = "LRU"
    max_workers: int = 2
    """Worker threads; server modules share the CPU pool with lookups, so keep it >= 2."""
    cpu_workers: int | None = None
    """Threads of the CPU pool (lookups and server-module calls), when not ``max_workers``."""
    transfer_mode: str = "auto"
    """``auto`` lets a CPU worker (which asks for engine_driven) and lmcache_driven clients both connect."""
    server_modules: tuple[dict[str, Any], ...] = ()
    """``--server-module`` JSON objects (``module_path``, ``factory_name``, ``config``)."""
    l2_adapters: tuple[dict[str, Any], ...] = ()
    """``--l2-adapter`` JSON objects, stacked in order."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Further flags passed through unchanged (e.g. ``--separate-object-groups``)."""


def server_argv(settings: ServerSettings, program: str | None = None) -> list[str]:
    """The ``lmcache server`` command line for ``settings``."""
    argv = [
        program or executable("lmcache"),
        "server",
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        "--http-host",
        settings.http_host,
        "--http-port",
        str(settings.http_port),
        "--chunk-size",
        str(settings.chunk_size),
        "--l1-size-gb",
        repr(float(settings.l1_size_gb)),
        "--eviction-policy",
        settings.eviction_policy,
        "--max-workers",
        str(settings.max_workers),
        *(("--max-cpu-workers", str(settings.cpu_workers)) if settings.cpu_workers is not None else ()),
        "--supported-transfer-mode",
        settings.transfer_mode,
        "--disable-metrics",
    ]
    for module in settings.server_modules:
        argv += ["--server-module", json.dumps(module, separators=(",", ":"))]
    for adapter in settings.l2_adapters:
        argv += ["--l2-adapter", json.dumps(adapter, separators=(",", ":"))]
    argv += list(settings.extra_args)
    return argv


class LMCacheServer:
    """A running ``lmcache server``; stop it with :meth:`stop` (by pid, whole process group)."""

    def __init__(self, settings: ServerSettings, process: ManagedProcess) -> None:
        self.settings = settings
        self.process = process

    @property
    def url(self) -> str:
        """ZMQ endpoint, e.g. ``tcp://127.0.0.1:5555``."""
        return f"tcp://{self.settings.host}:{self.settings.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.settings.http_host}:{self.settings.http_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def connector_extra_config(self, mq_timeout_s: float = 30.0) -> dict[str, Any]:
        """``kv_connector_extra_config`` entries that point LMCache's vLLM connector at this server."""
        return {
            "lmcache.mp.host": f"tcp://{self.settings.host}",
            "lmcache.mp.port": self.settings.port,
            "lmcache.mp.mq_timeout": mq_timeout_s,
        }

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The server's ``GET /status`` document."""
        return server_status(self.http_url, timeout_s)

    def l1_counts(self) -> dict[str, int]:
        """Object, lock and byte counts of the default L1 manager, from ``/status``."""
        return l1_counts(self.http_url)

    def wait_for_stores(self, settle_s: float = 0.3, timeout_s: float = 10.0) -> None:
        """See :func:`wait_for_stores`."""
        wait_for_stores(self.http_url, settle_s, timeout_s)

    def clear_l1(self, timeout_s: float = 10.0) -> None:
        """``POST /cache/clear``: drop every unlocked L1 object (L2 tiers keep theirs)."""
        request = urllib.request.Request(f"{self.http_url}/cache/clear", method="POST", data=b"")
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()

    def ping(self, timeout_s: float = 1.0) -> bool:
        """One RPC ``ping`` over a fresh ZMQ client."""
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        context = zmq.Context()
        context.setsockopt(zmq.LINGER, 0)  # a ping to a dead server must not block the probe's cleanup
        client = RequestClientFactory.create(self.url, context=context)
        try:
            return bool(client.ping(None).result(timeout=timeout_s))
        finally:
            client.close()
            context.term()

    def stop(self) -> int | None:
        return self.process.stop()


def server_status(http_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The ``GET /status`` document of the server whose HTTP endpoint is ``http_url``."""
    with urllib.request.urlopen(f"{http_url}/status", timeout=timeout_s) as resp:
        return json.load(resp)


def l1_counts(http_url: str) -> dict[str, int]:
    """Object, lock and byte counts of the server's default L1 manager, from ``/status``."""
    l1 = server_status(http_url)["storage_manager"]["l1_managers"]["_default"]
    keys = ("total_object_count", "read_locked_count", "write_locked_count", "memory_used_bytes")
    return {key: int(l1[key]) for key in keys}


class StoreSettling:
    """When the stores sent to a server have settled, from successive :func:`l1_counts` readings: nothing is
    write-locked, and the object count has not changed for ``settle_s`` (since it last changed or a lock was seen)."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._since: tuple[int, float] | None = None  # (object count, since when), while nothing is write-locked

    def settled(self, counts: dict[str, int], now: float) -> bool:
        if counts["write_locked_count"]:
            self._since = None
        elif self._since is None or self._since[0] != counts["total_object_count"]:
            self._since = (counts["total_object_count"], now)
        else:
            return now - self._since[1] >= self.settle_s
        return False


def wait_for_stores(http_url: str, settle_s: float = 0.3, timeout_s: float = 10.0) -> None:
    """Return once the stores sent to the server are visible to lookups: no object is write-locked (LMCache answers
    a KV store before its copy commits) and the object count held still for ``settle_s`` (R3 stores are sent in the
    background and may still arrive).

    Raises:
        TimeoutError: the stores did not settle within ``timeout_s``.
        ConnectionError: the server does not answer ``/status`` (it is not running, or ``http_url`` is wrong).
    """
    deadline = time.monotonic() + timeout_s
    watch = StoreSettling(settle_s)
    while True:
        try:
            counts = l1_counts(http_url)
        except OSError as error:
            raise ConnectionError(f"the LMCache server at {http_url} does not answer GET /status ({error}): "
                                  "is it running, and is this its server.http_port?") from error  # fmt: skip
        now = time.monotonic()
        if watch.settled(counts, now):
            return
        if now > deadline:
            raise TimeoutError(
                f"the LMCache server at {http_url} still took stores after {timeout_s:.0f} s "
                f"({counts['total_object_count']} objects, {counts['write_locked_count']} write-locked): see its log"
            )
        time.sleep(0.05)


def start_server(
    settings: ServerSettings,
    log_path: Path,
    ready_timeout_s: float = 90.0,
    env: dict[str, str] | None = None,
) -> LMCacheServer:
    """Start ``lmcache server`` and wait until both its RPC and HTTP ports answer.

    Raises:
        PortClashError: another process holds its request or HTTP port.
        ServiceStartError: it exited or did not become ready; the message quotes its log.
    """
    process = ManagedProcess(
        "lmcache server",
        server_argv(settings),
        log_path,
        env={"LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore", **(env or {})},
        listens=server_addresses(settings),
    )
    return _when_ready(LMCacheServer(settings, process), ready_timeout_s)


def start_config_server(config_file: Path, log_path: Path, ready_timeout_s: float = 90.0) -> LMCacheServer:
    """``lmcache-r3 server --config FILE`` (the documented way to run the server) as its own process, ready as
    :func:`start_server`'s.

    Raises:
        ConfigError: the file is not a valid lmcache_r3 config.
        PortClashError: another process holds a port the file gives it.
        ServiceStartError: it exited or did not become ready; the message quotes its log.
    """
    settings = settings_from_config(load_config(config_file))
    argv = [executable("lmcache-r3"), "server", "--config", str(config_file)]
    process = ManagedProcess("lmcache-r3 server", argv, log_path, listens=server_addresses(settings))
    return _when_ready(LMCacheServer(settings, process), ready_timeout_s)


def start_written_config_server(
    write_config: Callable[[], Path], log_path: Path, ready_timeout_s: float = 90.0
) -> tuple[Path, LMCacheServer]:
    """:func:`start_config_server` on the file ``write_config()`` writes (with ports it picks), written and started
    again when another process took one of its ports first; returns the file and the server.

    Raises:
        ServiceStartError: as :func:`start_config_server` (a clash three times running included).
    """

    def start() -> tuple[Path, LMCacheServer]:
        config_file = write_config()
        return config_file, start_config_server(config_file, log_path, ready_timeout_s)

    return start_on_fresh_ports(start)


def _when_ready(server: LMCacheServer, ready_timeout_s: float) -> LMCacheServer:
    """``server`` once both its RPC and HTTP ports answer; stopped, and the error raised, if it never does."""
    try:
        server.process.wait_ready(server.ping, ready_timeout_s, "answering RPC ping")
        server.process.wait_ready(lambda: bool(server.status(timeout_s=1.0)), ready_timeout_s, "serving /status")
    except BaseException:
        server.process.stop()
        raise
    return server


def server_addresses(settings: ServerSettings) -> tuple[tuple[str, int], ...]:
    """The ``(host, port)`` pairs the server listens on: its request port and its HTTP port."""
    return (settings.host, settings.port), (settings.http_host, settings.http_port)


def loopback_settings(**overrides: Any) -> ServerSettings:
    """:class:`ServerSettings` on two free loopback ports, with ``overrides``."""
    ports: dict[str, Any] = {"port": free_port(), "http_port": free_port()}
    ports.update(overrides)
    return ServerSettings(**ports)


def start_loopback_server(log_dir: Path, ready_timeout_s: float = 90.0, **overrides: Any) -> LMCacheServer:
    """:func:`start_server` on free loopback ports (:func:`loopback_settings` with ``overrides``), started again on
    new ports when another process took one of them first. Its log is ``log_dir/lmcache-server-<port>.log``.

    Raises:
        ServiceStartError: as :func:`start_server` (a clash three times running included).
    """

    def start() -> LMCacheServer:
        settings = loopback_settings(**overrides)
        return start_server(settings, Path(log_dir) / f"lmcache-server-{settings.port}.log", ready_timeout_s)

    return start_on_fresh_ports(start)


def r3_server_module_spec(namespace: str, tier_timeout_s: float | None = None) -> dict[str, Any]:
    """The ``--server-module`` JSON object that loads the R3 chunk type with ``namespace`` (and the module's own
    default bound on the tiers unless ``tier_timeout_s`` is given)."""
    config: dict[str, Any] = {"namespace": namespace}
    if tier_timeout_s is not None:
        config["tier_timeout_s"] = tier_timeout_s
    return {"module_path": R3_SERVER_MODULE, "factory_name": "build_server_modules", "config": config}


def settings_from_config(config) -> ServerSettings:
    """:class:`ServerSettings` for the ``server``, ``tiers`` and ``r3`` sections of a ``Config``."""
    server = config.server
    modules = (r3_server_module_spec(config.r3.namespace, config.r3_tier_timeout_s),) if config.r3.enabled else ()
    return ServerSettings(
        port=server.port,
        http_port=server.http_port,
        host=server.host,
        http_host=server.http_host,
        chunk_size=server.chunk_size,
        l1_size_gb=server.l1_size_gb,
        eviction_policy=server.eviction_policy,
        max_workers=server.max_workers,
        cpu_workers=server.max_workers + config.r3.workers if config.r3.enabled else None,
        transfer_mode=server.transfer_mode,
        server_modules=modules,
        l2_adapters=tuple(l2_adapter_spec(tier) for tier in config.tiers),
        extra_args=tuple(server.extra_args),
    )
