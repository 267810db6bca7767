"""The ``LMCACHE_CONFIG_FILE`` of an lmcache_r3 deployment: one yaml file for the server, its tiers, routed
experts and the vLLM connector.

``lmcache-r3 server`` turns the ``server``, ``tiers`` and ``r3`` sections into a stock ``lmcache server`` command
line; the connector reads ``connector`` and ``r3`` from the same file. Every key is typed; an unknown key, a
wrong type or an impossible value fails at load time with the key's path and what is allowed, e.g.::

    lmcache_r3 config /etc/lmcache.yaml: server.chunk_size: expected an integer >= 32, got 0

A complete example lives in ``examples/lmcache_r3.yaml``; docs/config.md documents every key.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from lmcache_r3.tiers.plugins import required_parameters

CONFIG_ENV_VAR = "LMCACHE_CONFIG_FILE"
CONFIG_EXTRA_KEY = "lmcache_r3.config_file"
"""``kv_connector_extra_config`` key naming the file for one engine (else ``$LMCACHE_CONFIG_FILE``)."""

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
"""A bound in seconds: more than 0, at most a day (an infinite or huge bound is a hang)."""
MAX_R3_STORE_BATCH_STEPS = 1024


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` is a finite number of seconds above 0 (an int or a float; a bool is neither)."""
    return type(value) in (int, float) and 0 < value < math.inf


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file, the key path and the fix."""


SEPARATE_GROUPS_FLAGS = ("--separate-object-groups", "--no-separate-object-groups")
RESERVED_SERVER_FLAGS = {
    "--host": "host", "--port": "port", "--http-host": "http_host", "--http-port": "http_port",
    "--chunk-size": "chunk_size", "--l1-size-gb": "l1_size_gb", "--eviction-policy": "eviction_policy",
    "--max-workers": "max_workers", "--max-cpu-workers": "max_workers and r3.workers",
    "--supported-transfer-mode": "transfer_mode", "--l2-adapter": "tiers",
    "--transport": "connector.server_url (only tcp:// is served)",
}  # fmt: skip
"""``lmcache server`` flags lmcache_r3 sets from typed keys (the key to use instead): given again in ``extra_args``
they would win on the server's command line while the connector and ``inspect`` still read the key. (Another
``--server-module`` is welcome: that flag adds a module next to the R3 one.)"""


def extra_args_problem(extra_args: list[str]) -> str | None:
    """Why ``extra_args`` cannot be passed to ``lmcache server`` as they are, or None.

    argparse takes the last of a repeated flag and accepts any unambiguous abbreviation, so a reserved flag is
    refused in its full form, its ``--flag=value`` form and as an abbreviation; so are abbreviations of the
    ``--separate-object-groups`` pair, which the connector reads from ``extra_args`` (see :attr:`separate_groups`).
    """
    for arg in extra_args:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        for flag, key in RESERVED_SERVER_FLAGS.items():
            if flag.startswith(name):
                return f"{arg!r} sets what the {key} key sets; use the key (the server and the connector both read it)"
        for flag in SEPARATE_GROUPS_FLAGS:
            if flag.startswith(name) and name != flag:
                return f"{arg!r} abbreviates {flag}; spell the flag out (the connector reads it from extra_args)"
            if name == flag and name != arg:
                return f"{arg!r}: {flag} takes no value (the server would refuse it at start)"
    return None


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The ``lmcache server`` process."""

    host: str = "127.0.0.1"
    """Address the request port binds to; the connector connects here."""
    port: Port = 5555
    """ZMQ request port; the connector connects here."""
    http_host: str = "127.0.0.1"
    """Address the HTTP port binds to. Its API (``/status``, ``/cache/clear``, quotas) has no authentication, so it
    stays on loopback unless this says otherwise."""
    http_port: Port = 8080
    """HTTP port of ``/status`` and ``/cache/clear``."""
    chunk_size: Annotated[int, msgspec.Meta(ge=32)] = 256
    """Tokens per LMCache chunk (and per R3 object); a multiple of vLLM's block size."""
    l1_size_gb: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Size of the in-memory (L1) cache; allocated up front."""
    eviction_policy: Literal["LRU", "ARC", "IsolatedLRU", "noop"] = "LRU"
    max_workers: Annotated[int, msgspec.Meta(ge=2, le=256)] = 2
    """Worker threads; the R3 module shares the CPU pool with lookups, so at least 2."""
    transfer_mode: Literal["auto", "lmcache_driven", "engine_driven"] = "auto"
    """KV transfer modes the server accepts; ``auto`` accepts both (CPU workers ask for engine_driven)."""
    extra_args: list[str] = msgspec.field(default_factory=list)
    """Further ``lmcache server`` flags, passed through unchanged (e.g. ``--separate-object-groups``)."""

    def __post_init__(self) -> None:
        if self.port == self.http_port:
            raise ValueError(f"port and http_port are both {self.port}; give them different ports")
        for key, host in (("host", self.host), ("http_host", self.http_host)):
            if not host:
                raise ValueError(f"{key} is empty; use 127.0.0.1 for a single-host deployment")
            if ":" in host:
                raise ValueError(
                    f"{key} {host!r} is an IPv6 address, which the connector's tcp://host:port URLs and "
                    "lmcache-r3 inspect cannot carry; use an IPv4 address or a host name"
                )
        if not math.isfinite(self.l1_size_gb):
            raise ValueError(f"l1_size_gb must be a finite size in GB, got {self.l1_size_gb}")
        problem = extra_args_problem(self.extra_args)
        if problem:
            raise ValueError(f"extra_args: {problem}")

    @property
    def separate_groups(self) -> bool:
        """Whether the server runs with ``--separate-object-groups``: the last of the pair in ``extra_args``."""
        given = [arg for arg in self.extra_args if arg in SEPARATE_GROUPS_FLAGS]
        return bool(given) and given[-1] == SEPARATE_GROUPS_FLAGS[0]


class R3Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Routed experts stored next to the KV."""

    enabled: bool = True
    """Store and return routed experts; off means a plain KV cache (the connector behaves as stock)."""
    namespace: str = "##r3"
    """Suffix appended to the model name of R3 objects, so KV lookups and KV events never see them."""
    workers: Annotated[int, msgspec.Meta(ge=0, le=256)] = 2
    """Threads added to the server's CPU pool for the R3 module (``--max-cpu-workers`` = ``server.max_workers`` +
    this). R3 calls run on the pool that serves LMCache's KV lookups; with only ``max_workers`` threads, an R3
    store and fetch in flight hold them all and every KV lookup waits behind them."""
    tier_timeout_s: PositiveSeconds | None = None
    """Longest the server waits for the L2 tiers to bring R3 objects into L1 for one lookup or fetch (past it the
    answer is a miss); default 0.8 x ``connector.r3_timeout_s``. Below that bound: the connector stops waiting then,
    and a server thread kept waiting longer is one KV lookups lack. See :attr:`Config.r3_tier_timeout_s`."""

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "@/\\\0"):
            raise ValueError(
                f"namespace {self.namespace!r} must be non-empty and contain none of @ / \\ NUL "
                "(LMCache object keys reserve them)"
            )


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The vLLM side (``LMCacheMPConnector`` from ``lmcache_r3.mp.connector``)."""

    server_url: str | None = None
    """``tcp://host:port`` of the server; default: ``server.host`` and ``server.port`` of this file."""
    mq_timeout_s: PositiveSeconds = 30.0
    """Bound on any one KV request to the server before the connector gives up and recomputes."""
    r3_timeout_s: PositiveSeconds = 5.0
    """Bound on an R3 lookup, store or fetch; past it the R3 hit counts as a miss."""
    r3_store_batch_steps: Annotated[int, msgspec.Meta(ge=0, le=MAX_R3_STORE_BATCH_STEPS)] = 8
    """Engine steps the R3 of chunks of prompt tokens may wait to be sent in one store call with later ones (0:
    nothing waits, every step sends its own). The R3 of chunks holding generated tokens, which only a request whose
    prompt holds them can use, waits until its request ends or is preempted (or 8 MiB wait); a request's R3 is sent
    no later than the step it ends in."""
    save_decode_cache: bool = False
    """Also store the KV (and routed experts) of generated tokens, so a multi-turn rollout's next turn reuses the
    previous answer; off stores prompt tokens only (LMCache's default)."""

    def __post_init__(self) -> None:
        url = self.server_url
        if url is None:
            return
        if not re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", url) or not 0 < int(url.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"server_url {url!r} must look like tcp://127.0.0.1:5555 (a port in 1..65535)")


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One deployment: server, storage tiers, routed experts, connector."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    tiers: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """LMCache L2 adapters, in order; each is the JSON object of one ``--l2-adapter`` flag (a ``type`` key first)."""
    r3: R3Config = msgspec.field(default_factory=R3Config)
    connector: ConnectorConfig = msgspec.field(default_factory=ConnectorConfig)

    @property
    def r3_tier_timeout_s(self) -> float:
        """The server's bound on the tiers for one R3 read: ``r3.tier_timeout_s``, or 0.8 x the connector's bound."""
        explicit = self.r3.tier_timeout_s
        return explicit if explicit is not None else 0.8 * self.connector.r3_timeout_s

    def __post_init__(self) -> None:
        tier_timeout_s = self.r3.tier_timeout_s
        if self.r3.enabled and tier_timeout_s is not None and tier_timeout_s >= self.connector.r3_timeout_s:
            raise ValueError(
                f"r3.tier_timeout_s ({self.r3.tier_timeout_s}) must be below connector.r3_timeout_s "
                f"({self.connector.r3_timeout_s}): the connector gives up on an R3 call then, and the server would "
                "keep a thread waiting for the tiers after nobody waits for the answer"
            )
        for index, tier in enumerate(self.tiers):
            kind = tier.get("type")
            if not isinstance(kind, str) or not kind:
                raise ValueError(
                    f"tiers[{index}] has no 'type'; each tier needs one, e.g. {{type: fs, base_path: /data/l2}}"
                )
            for key in required_parameters(kind):
                if key not in tier:
                    raise ValueError(
                        f"tiers[{index}].{key}: required for a tier of type {kind} "
                        f"(e.g. {{type: shm, root: /dev/shm/lmcache_r3, capacity_bytes: 8589934592}})"
                    )

    @property
    def server_url(self) -> str:
        return self.connector.server_url or f"tcp://{self.server.host}:{self.server.port}"


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "": Config,
    "server": ServerConfig,
    "r3": R3Config,
    "connector": ConnectorConfig,
}


def parse_config(document: Any, source: str = "<config>") -> Config:
    """Validate an already-parsed yaml document.

    Raises:
        ConfigError: naming ``source``, the key path and what is allowed.
    """
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigError(f"lmcache_r3 config {source}: the top level must be a mapping, got {type(document).__name__}")
    try:
        return msgspec.convert(document, Config)
    except msgspec.ValidationError as err:
        raise ConfigError(f"lmcache_r3 config {source}: {_explain(str(err))}") from None


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read the config from ``path``, else from ``$LMCACHE_CONFIG_FILE``, else the defaults.

    Raises:
        ConfigError: unreadable file, invalid yaml, or an invalid key (see :func:`parse_config`).
    """
    if path is None:
        path = os.environ.get(CONFIG_ENV_VAR) or None
    if path is None:
        return Config()
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as err:
        raise ConfigError(
            f"lmcache_r3 config {file}: cannot read it ({err.strerror}); set {CONFIG_ENV_VAR} or --config to a "
            "readable yaml file"
        ) from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"lmcache_r3 config {file}: not valid yaml: {err}") from None
    return parse_config(document, str(file))


def _explain(message: str) -> str:
    """Turn msgspec's ``... - at `$.a.b``` into ``a.b: ...`` and list the allowed keys for an unknown one."""
    match = re.fullmatch(r"(?s)(.*?)(?: - at `\$(.*)`)?", message)
    detail, where = (match.group(1), (match.group(2) or "").lstrip(".")) if match else (message, "")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", detail)
    if unknown:
        section = re.sub(r"\[\d+\]", "", where)
        struct = _SECTIONS.get(section)
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        allowed = ", ".join(struct.__struct_fields__) if struct else "see docs/config.md"
        return f"{key}: unknown key; allowed here: {allowed}"
    detail = detail.replace("Expected `int`", "expected an integer").replace("Expected `float`", "expected a number")
    detail = detail.replace("Expected `bool`", "expected true or false").replace("Expected `str`", "expected a string")
    return f"{where}: {detail}" if where else detail


def load_connector_config(extra_config: Mapping[str, Any] | None) -> Config:
    """The config a vLLM engine's connector uses: the file named by ``kv_connector_extra_config`` under
    ``lmcache_r3.config_file``, else ``$LMCACHE_CONFIG_FILE``, else the defaults.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    path = (extra_config or {}).get(CONFIG_EXTRA_KEY)
    return load_config(path if path else None)


def stock_connector_extra_config(config: Config, extra_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``lmcache.mp.*`` entries LMCache's MP connector reads, from ``config``.

    Entries the user set explicitly in ``kv_connector_extra_config`` win over the file.

    Example: ``server: {host: 127.0.0.1, port: 5555}`` gives ``{"lmcache.mp.host": "tcp://127.0.0.1",
    "lmcache.mp.port": 5555, "lmcache.mp.mq_timeout": 30.0}``.
    """
    host, port = config.server_url.removeprefix("tcp://").rsplit(":", 1)
    entries: dict[str, Any] = {
        "lmcache.mp.host": f"tcp://{host}",
        "lmcache.mp.port": int(port),
        "lmcache.mp.mq_timeout": config.connector.mq_timeout_s,
        "lmcache.mp.save_decode_cache": config.connector.save_decode_cache,
    }
    entries.update(extra_config or {})
    return entries
