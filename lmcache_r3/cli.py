"""``lmcache-r3``: the project's command line.

lmcache-r3 server [--config PATH] [--print-command]   run the LMCache MP server the config file describes
lmcache-r3 inspect [--config PATH | --url URL]        the running server's status, with the R3 counters
lmcache-r3 clear [--config PATH | --url URL]          empty the running server's L1 and its lmcache_r3 tiers
lmcache-r3 demo                                       the main job end to end on this machine
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import sys
import urllib.error
import urllib.request

from lmcache_r3.config import CONFIG_ENV_VAR, ConfigError, load_config
from lmcache_r3.launch import TELEMETRY_OFF, ServiceStartError, addresses_in_use, service_env


def _server(args: argparse.Namespace) -> int:
    from lmcache_r3.mp.server_process import server_addresses, server_argv, settings_from_config

    config = load_config(args.config)
    server_settings = settings_from_config(config)
    argv = server_argv(server_settings)
    settings = {**TELEMETRY_OFF, "LMCACHE_DISABLE_BANNER": "1"}
    if args.print_command:  # with the environment it runs in: LMCache reports usage unless told not to
        print(shlex.join(["env", *(f"{name}={value}" for name, value in settings.items()), *argv]))
        return 0
    # LMCache would die on it with a ZMQ or uvicorn traceback; the config key is what the operator changes
    keys = dict(zip(server_addresses(server_settings), ("server.port", "server.http_port"), strict=True))
    for host, port in addresses_in_use(list(keys)):
        source = args.config or os.environ.get(CONFIG_ENV_VAR) or "the config file"
        print(f"lmcache-r3 server: {host}:{port} ({keys[host, port]}) is in use by another process (another "
              f"lmcache server?): stop it, or set another {keys[host, port]} in {source}", file=sys.stderr)  # fmt: skip
        return 1
    try:
        os.execve(argv[0], argv, service_env(settings))
    except OSError as err:
        print(f"lmcache-r3 server: cannot run {argv[0]} ({err.strerror}); install lmcache 0.5.6 here", file=sys.stderr)
        return 1
    return 1  # not reached


def _inspect(args: argparse.Namespace) -> int:
    if args.url:
        base = args.url.rstrip("/")
    else:
        server = load_config(args.config).server
        base = f"http://{server.http_host}:{server.http_port}"
    if not base.startswith(("http://", "https://")):
        print(f"lmcache-r3 inspect: --url {base!r} needs its scheme, e.g. http://127.0.0.1:8080", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(f"{base}/status", timeout=args.timeout) as resp:
            status = json.load(resp)
    except urllib.error.HTTPError as err:
        print(f"lmcache-r3 inspect: {base}/status answered HTTP {err.code} {err.reason}: something answers there, "
              "but not an LMCache server's status (its log says why if it is one)", file=sys.stderr)  # fmt: skip
        return 1
    except http.client.HTTPException as err:  # not HTTP at all, e.g. the server's ZMQ request port
        print(f"lmcache-r3 inspect: {base}/status did not answer in HTTP ({type(err).__name__}): is this the "
              "server's HTTP port (server.http_port), not its request port?", file=sys.stderr)  # fmt: skip
        return 1
    except (urllib.error.URLError, OSError) as err:
        print(
            f"lmcache-r3 inspect: no LMCache server answers at {base}/status ({err}); is it running?", file=sys.stderr
        )
        return 1
    except ValueError as err:  # something else answered, not with JSON
        print(f"lmcache-r3 inspect: {base}/status did not answer with JSON ({err}): is this the server's HTTP port "
              "(server.http_port)?", file=sys.stderr)  # fmt: skip
        return 1
    if not isinstance(status, dict):
        print(f"lmcache-r3 inspect: {base}/status answered JSON that is not an LMCache status (a "
              f"{type(status).__name__}, not an object)", file=sys.stderr)  # fmt: skip
        return 1
    print(json.dumps(summarize_status(status), indent=2, sort_keys=True))
    return 0


def _clear(args: argparse.Namespace) -> int:
    """Clear one server's L1 and its lmcache_r3 tiers (after a policy update); exit 1 if anything may remain."""
    from lmcache_r3.mp.clearing import clear_servers

    url = args.url or load_config(args.config).server_url
    if not url.startswith("tcp://"):
        print(f"lmcache-r3 clear: --url {url!r} is the server's request port as tcp://HOST:PORT (server.port), "
              "e.g. tcp://127.0.0.1:5555", file=sys.stderr)  # fmt: skip
        return 2
    (answer,) = clear_servers([url], timeout_s=args.timeout)
    if answer.no_module:
        print(f"lmcache-r3 clear: {url} did not answer lmcache_r3's info: no server there, or one without the "
              "lmcache_r3 server module (a stock lmcache server: start it with `lmcache-r3 server`, or clear its L1 "
              "with POST /cache/clear; its L2 tiers then stay)", file=sys.stderr)  # fmt: skip
        return 1
    if answer.response is not None:
        tiers = [{"tier": t.index, "type": t.type, "removed": t.removed, **({"error": t.error} if t.error else {})}
                 for t in answer.response.tiers]  # fmt: skip
        print(json.dumps({"server": url, "l1": "cleared", "tiers": tiers}, indent=2))
    for problem in answer.problems:
        print(f"lmcache-r3 clear: not cleared: {problem}", file=sys.stderr)
    return 1 if answer.problems else 0


def summarize_status(status: dict) -> dict:
    """The parts of ``/status`` an operator of lmcache_r3 looks at: health, sessions, L1 use and locks, R3 and tiers.

    ``active_sessions`` counts requests whose session the server still holds: running requests, and finished ones
    until their stores are done (one that stays after its engine went idle leaked, and expires with the server's
    session TTL).
    """
    l1 = status.get("storage_manager", {}).get("l1_managers", {}).get("_default", {})
    keys = ("total_object_count", "read_locked_count", "write_locked_count", "memory_used_bytes")
    summary = {
        "healthy": status.get("is_healthy", status.get("healthy")),
        "active_sessions": status.get("active_sessions"),
        "l1": {key: l1.get(key) for key in keys},
        # LMCache merges each server module's report_status() into the top level of /status.
        "r3": status.get("lmcache_r3"),
        "tiers": [_tier_summary(adapter) for adapter in status.get("storage_manager", {}).get("l2_adapters", [])],
    }
    return summary


TIER_COUNTERS = (
    *("hits", "misses", "bytes", "errors", "evictions", "corrupt", "objects", "capacity_bytes"),
    *("raced", "recycled", "pooled_bytes"),  # the shm tier's recycled files
    *("l1_region_bytes", "direct_written", "direct_read"),  # the Mooncake tier's moves straight from and into L1
)


def _tier_summary(adapter: dict) -> dict:
    """One L2 tier: its type, health and the counters it reports (lmcache_r3's tiers report all of them)."""
    summary = {"type": adapter.get("type"), "healthy": adapter.get("is_healthy")}
    summary.update({key: adapter[key] for key in TIER_COUNTERS if key in adapter})
    if adapter.get("reason"):
        summary["reason"] = adapter["reason"]
    return summary


def _demo(rest: list[str]) -> int:
    from lmcache_r3.demo.run import main as demo_main

    return demo_main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-r3", description="Routed experts and KV cache in LMCache.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    server = commands.add_parser("server", help="run the LMCache MP server described by the config file")
    server.add_argument("--config", default=None, help=f"yaml file (default: ${CONFIG_ENV_VAR})")
    server.add_argument("--print-command", action="store_true", help="print the command line instead of running it")
    server.set_defaults(handler=_server)

    inspect = commands.add_parser("inspect", help="the running server's status, with the R3 counters")
    inspect.add_argument("--config", default=None, help=f"yaml file (default: ${CONFIG_ENV_VAR})")
    inspect.add_argument("--url", default=None, help="HTTP address of the server, e.g. http://127.0.0.1:8080")
    inspect.add_argument("--timeout", type=float, default=5.0)
    inspect.set_defaults(handler=_inspect)

    clear = commands.add_parser("clear", help="empty the running server's L1 and its lmcache_r3 tiers")
    clear.add_argument("--config", default=None, help=f"yaml file (default: ${CONFIG_ENV_VAR})")
    clear.add_argument("--url", default=None, help="request address of the server, e.g. tcp://127.0.0.1:5555")
    clear.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer (default 60)")
    clear.set_defaults(handler=_clear)

    commands.add_parser("demo", help="run the main job end to end (LMCache MP server + vLLM on CPU)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own arguments
        command, run = "demo", lambda: _demo(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        command, run = args.command, lambda: args.handler(args)
    try:
        return run()
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except ServiceStartError as err:  # e.g. no `lmcache` executable in this environment
        print(f"lmcache-r3 {command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
