"""Settings of the Mooncake tier: the Mooncake client config, the master's health URL, and the tier's bounds.

The Mooncake client config comes from ``adapter_params.mooncake`` (the fields of the JSON file that
``mooncake.mooncake_config.MooncakeConfig.load_from_env`` reads) or, when that key is absent, from
``MooncakeConfig.load_from_env()`` itself (``MOONCAKE_CONFIG_PATH``, or the ``MOONCAKE_MASTER`` variables).
Inline, ``local_hostname``, ``metadata_server`` and ``master_server_address`` are required; the tier defaults to
``global_segment_size = 0`` (this process lends no memory: separate ``mooncake_client`` holders do, so objects
outlive the LMCache server) and a 16 MiB ``local_buffer_size`` (the tier never uses that buffer); a file or the
environment keeps Mooncake's own defaults (a 3.125 GiB segment lent by this process, a 1 GiB local buffer).

The master's health URL is ``http://<host of master_server_address>:<master_metrics_port>/health`` (the master's
``--metrics_port``, 9003 by default), or ``master_health_url`` when given.

Every error is a :class:`MooncakeTierConfigError` naming the key and the fix, e.g.
``adapter_params.mooncake.master_server_address is required (a non-empty string), got None; e.g. {...}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake.mooncake_config import MooncakeConfig

_MOONCAKE_KEYS = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "device_name",
    "master_server_address",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
)
_REQUIRED_MOONCAKE_KEYS = ("local_hostname", "metadata_server", "master_server_address")
_SIZE_UNITS = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40), ("k", 1 << 10), ("m", 1 << 20))
_SIZE_UNITS += (("g", 1 << 30), ("t", 1 << 40), ("b", 1))

STORE_PARAMS = frozenset(
    {
        "mooncake",
        "master_metrics_port",
        "master_health_url",
        "call_timeout_seconds",
        "probe_interval_seconds",
        "retry_after_seconds",
        "batch_bytes",
        "batch_max_objects",
        "num_io_threads",
        "zero_copy_min_bytes",
        "inline_max_bytes",
        "direct_reads",
        "direct_read_max_seconds",
        "transfer_progress_timeout_seconds",
    }
)
"""The ``adapter_params`` keys :func:`settings_from_params` reads."""


MAX_PARTS_IN_FLIGHT = 2048
"""Most transfer parts one Mooncake client keeps in flight here: 4 concurrent calls of 512 staged objects each
succeed, 4 of 1024 (or one of 3000) fail with ``TRANSFER_FAIL`` (Mooncake 0.3.13.post1, TCP transport)."""


class MooncakeTierConfigError(ValueError):
    """A missing or bad setting; the message names the key and the fix."""


@dataclass(frozen=True)
class MooncakeTierSettings:
    """Everything :class:`lmcache_r3.tiers.mooncake_store.MooncakeObjectStore` needs; build it with
    :func:`settings_from_params`."""

    mooncake: MooncakeConfig
    """What ``MooncakeDistributedStore.setup`` gets."""
    health_url: str
    """The master's ``GET /health``, probed before ``setup`` and while connected."""
    call_timeout_seconds: float = 2.0
    """Longest wait for one Mooncake call before it is abandoned as ``TIMEOUT``."""
    probe_interval_seconds: float = 0.5
    retry_after_seconds: float = 2.0
    """After a timeout or ``RPC_FAIL``, calls fail fast for at least this long."""
    batch_bytes: int = 64 << 20
    """Largest staging buffer one call uses; bigger batches are split (a bigger object gets its own)."""
    batch_max_objects: int = 256
    """Most objects one transfer call moves; bigger batches are split. Mooncake's transfer engine fails every
    transfer of a client that has more than about 2048 parts (a staged object is one, a direct one two) in flight at
    once (``TRANSFER_FAIL``, and its reads then stall for up to a minute), so ``2 * num_io_threads *
    batch_max_objects`` may be at most :data:`MAX_PARTS_IN_FLIGHT`."""
    num_io_threads: int = 4
    zero_copy_min_bytes: int = 512 << 10
    """Objects at least this big that lie in the registered L1 region move without staging; smaller ones are staged
    (for them one transfer slice and a copy cost less than the two slices of header and payload)."""
    inline_max_bytes: int = 4 << 20
    """A put or get of at most this many bytes that takes one staged call (R3 objects) runs without a worker: it is
    staged on the caller's thread and completed on the client's call thread when the call returns, saving the two
    thread wake-ups of a hand-off to a worker and back. 0: every task runs on a worker."""
    direct_reads: bool = True
    """Whether reads, not only writes, move direct into L1. A direct transfer is never abandoned while it may still
    write into L1 (see ``direct_read_max_seconds``); a direct write is always safe (a late read of reused memory
    stores an object that fails its checksum)."""
    direct_read_max_seconds: float = 60.0
    """Longest wait for a direct transfer into L1 (Mooncake's transport ends a stalled one within
    ``transfer_progress_timeout_seconds`` of its last byte). One that outlives it is abandoned, the tier reports
    itself unhealthy, and every later read is staged."""
    transfer_progress_timeout_seconds: int = 2
    """``MC_TCP_PROGRESS_TIMEOUT_SEC`` for this process's Mooncake client (unless already set): how long the TCP
    transport waits for the next byte of a transfer before failing it and dropping the connection."""


def parse_size(name: str, value: Any) -> int:
    """Bytes from an int or a string like ``"512MB"`` / ``"1.5g"``; e.g. ``parse_size("x", "64KB") == 65536``.

    Raises:
        MooncakeTierConfigError: naming ``name`` when the value is not a non-negative size.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text, scale = value.strip().lower(), 1
        for unit, factor in _SIZE_UNITS:
            if text.endswith(unit):
                text, scale = text[: -len(unit)].strip(), factor
                break
        try:
            number = float(text)
        except ValueError:
            number = -1.0
        if 0 <= number < float("inf"):
            return int(number * scale)
    raise MooncakeTierConfigError(
        f"{name} must be a size in bytes (an int >= 0, or a string like '512MB'), got {value!r}"
    )


def mooncake_config(inline: Mapping[str, Any] | None) -> MooncakeConfig:
    """The Mooncake client config: ``inline`` (``adapter_params.mooncake``), else ``MOONCAKE_CONFIG_PATH``.

    ``inline`` holds the fields of the JSON file that ``MooncakeConfig.load_from_env`` reads; without it, that
    function is called (``MOONCAKE_CONFIG_PATH``, or the ``MOONCAKE_MASTER`` family of variables).

    Raises:
        MooncakeTierConfigError: naming the missing or bad key and how to fix it.
    """
    if inline is None:
        return _config_from_env()
    where = "adapter_params.mooncake"
    if not isinstance(inline, Mapping):
        raise MooncakeTierConfigError(f"{where} must be a JSON object of Mooncake settings, got {inline!r}")
    unknown = sorted(set(inline) - set(_MOONCAKE_KEYS))
    if unknown:
        raise MooncakeTierConfigError(f"{where}: unknown keys {unknown}; known keys: {list(_MOONCAKE_KEYS)}")
    for key in _REQUIRED_MOONCAKE_KEYS:
        if not isinstance(inline.get(key), str) or not inline[key].strip():
            raise MooncakeTierConfigError(
                f"{where}.{key} is required (a non-empty string), got {inline.get(key)!r}; e.g. "
                '{"local_hostname": "10.0.0.2", "metadata_server": "P2PHANDSHAKE", '
                '"master_server_address": "10.0.0.1:50051"}'
            )
    fields = dict(inline)
    for key in ("global_segment_size", "local_buffer_size"):
        if key in fields:
            fields[key] = parse_size(f"{where}.{key}", fields[key])
    fields.setdefault("global_segment_size", 0)
    fields.setdefault("local_buffer_size", 16 << 20)
    fields.setdefault("protocol", "tcp")
    fields.setdefault("device_name", "")
    try:
        return MooncakeConfig(**fields)
    except (TypeError, ValueError) as err:
        raise MooncakeTierConfigError(f"{where}: {err}; fix that field") from err


def _config_from_env() -> MooncakeConfig:
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path and not os.environ.get("MOONCAKE_MASTER"):
        raise MooncakeTierConfigError(
            "no Mooncake configuration: give adapter_params.mooncake (an object with local_hostname, "
            "metadata_server and master_server_address) or export MOONCAKE_CONFIG_PATH=/path/to/mooncake.json "
            "for the server process"
        )
    source = f"MOONCAKE_CONFIG_PATH={path!r}" if path else "the MOONCAKE_MASTER environment"
    try:
        return MooncakeConfig.load_from_env()
    except OSError as err:
        raise MooncakeTierConfigError(
            f"{source} cannot be read ({err.strerror}); point MOONCAKE_CONFIG_PATH at a readable JSON file"
        ) from err
    except json.JSONDecodeError as err:
        raise MooncakeTierConfigError(f"{source} is not valid JSON ({err}); fix the file") from err
    except (TypeError, ValueError) as err:
        raise MooncakeTierConfigError(f"Mooncake config from {source}: {err}; fix that field") from err


def settings_from_params(params: Mapping[str, Any]) -> MooncakeTierSettings:
    """:class:`MooncakeTierSettings` from the ``STORE_PARAMS`` keys of ``params`` (other keys are ignored).

    Raises:
        MooncakeTierConfigError: naming the bad key and the fix.
    """
    config = mooncake_config(params.get("mooncake"))
    health_url = params.get("master_health_url")
    if health_url is None:
        port = params.get("master_metrics_port", 9003)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise MooncakeTierConfigError(
                f"adapter_params.master_metrics_port must be the master's --metrics_port (1..65535), got {port!r}"
            )
        host, sep, rpc_port = config.master_server_address.rpartition(":")
        if not sep or not host or not rpc_port.isdigit() or any(c in host for c in "/;, "):
            raise MooncakeTierConfigError(
                f"master_server_address {config.master_server_address!r} is not host:port, so the master's health "
                f"URL cannot be derived; set adapter_params.master_health_url (e.g. http://master:9003/health)"
            )
        health_url = f"http://{host}:{port}/health"
    elif not isinstance(health_url, str) or not health_url.startswith(("http://", "https://")):
        raise MooncakeTierConfigError(f"adapter_params.master_health_url must be an http(s) URL, got {health_url!r}")
    values: dict[str, Any] = {}
    for key in ("call_timeout_seconds", "probe_interval_seconds", "retry_after_seconds"):
        if key in params:
            value = params[key]
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 3600:
                raise MooncakeTierConfigError(f"adapter_params.{key} must be a number of seconds > 0, got {value!r}")
            values[key] = float(value)
    if "batch_bytes" in params:
        values["batch_bytes"] = max(1, parse_size("adapter_params.batch_bytes", params["batch_bytes"]))
    if "zero_copy_min_bytes" in params:
        values["zero_copy_min_bytes"] = parse_size("adapter_params.zero_copy_min_bytes", params["zero_copy_min_bytes"])
    if "inline_max_bytes" in params:
        values["inline_max_bytes"] = parse_size("adapter_params.inline_max_bytes", params["inline_max_bytes"])
    if "direct_read_max_seconds" in params:
        value = params["direct_read_max_seconds"]
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 3600:
            raise MooncakeTierConfigError(
                f"adapter_params.direct_read_max_seconds must be a number of seconds > 0, got {value!r}"
            )
        values["direct_read_max_seconds"] = float(value)
    if "transfer_progress_timeout_seconds" in params:
        value = params["transfer_progress_timeout_seconds"]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 3600:
            raise MooncakeTierConfigError(
                f"adapter_params.transfer_progress_timeout_seconds must be an int of seconds >= 1, got {value!r}"
            )
        values["transfer_progress_timeout_seconds"] = value
    if "direct_reads" in params:
        if not isinstance(params["direct_reads"], bool):
            raise MooncakeTierConfigError(
                f"adapter_params.direct_reads must be true or false, got {params['direct_reads']!r}"
            )
        values["direct_reads"] = params["direct_reads"]
    if "num_io_threads" in params:
        threads = params["num_io_threads"]
        if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
            raise MooncakeTierConfigError(f"adapter_params.num_io_threads must be an int in 1..64, got {threads!r}")
        values["num_io_threads"] = threads
    if "batch_max_objects" in params:
        count = params["batch_max_objects"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise MooncakeTierConfigError(f"adapter_params.batch_max_objects must be an int >= 1, got {count!r}")
        values["batch_max_objects"] = count
    threads = values.get("num_io_threads", MooncakeTierSettings.num_io_threads)
    count = values.get("batch_max_objects", MooncakeTierSettings.batch_max_objects)
    if 2 * threads * count > MAX_PARTS_IN_FLIGHT:
        raise MooncakeTierConfigError(
            f"adapter_params.num_io_threads ({threads}) x batch_max_objects ({count}) may keep {2 * threads * count} "
            f"transfer parts in flight, and Mooncake fails every transfer of a client past about "
            f"{MAX_PARTS_IN_FLIGHT}; lower one so that 2 x num_io_threads x batch_max_objects <= {MAX_PARTS_IN_FLIGHT}"
        )
    return MooncakeTierSettings(mooncake=config, health_url=health_url, **values)
