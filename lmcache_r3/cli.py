"""``lmcache-r3``: the project's command line.

lmcache-r3 demo     run the main job end to end on this machine (LMCache MP server + vLLM CPU)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lmcache-r3", description="Routed experts and KV cache in LMCache.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "demo", help="run the main job end to end (LMCache MP server + vLLM on CPU)", add_help=False
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from lmcache_r3.demo.run import main as demo_main

        return demo_main(rest)
    parser.error(f"unknown command '{command}'; choose from: demo")
    return 2


if __name__ == "__main__":
    sys.exit(main())
