"""The ``hyper-parallel`` command line: ``hyper-parallel plugins [--json]``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hyper_parallel import __version__
from hyper_parallel.core.plugin import PluginKind, get_registry

__all__ = ["main"]


def _plugins_report() -> dict[str, Any]:
    registry = get_registry()
    return {
        "entries": [
            {
                "kind": e.kind.value,
                "name": e.name,
                "aliases": list(e.aliases),
                "description": e.description,
                "plugin": e.plugin,
                "distribution": e.distribution,
            }
            for e in registry.entries()
        ],
        "plugins": [
            {
                "name": p.name,
                "distribution": p.distribution,
                "entry_point": p.entry_point,
                "status": p.status,
                "error": p.error,
            }
            for p in registry.plugins()
        ],
    }


def _print_table(report: dict[str, Any]) -> None:
    for kind in PluginKind:
        rows = [e for e in report["entries"] if e["kind"] == kind.value]
        print(f"{kind.label}s ({len(rows)}):")
        if not rows:
            print("  (none)")
        width = max((len(r["name"]) for r in rows), default=0)
        for r in rows:
            aliases = f" (aliases: {', '.join(r['aliases'])})" if r["aliases"] else ""
            source = r["distribution"] or "registered in-process"
            print(
                f"  {r['name']:<{width}}  {r['description']}{aliases}  [{r['plugin']} from {source}]"
            )
        print()
    problems = [p for p in report["plugins"] if p["status"] != "loaded"]
    for p in problems:
        detail = f": {p['error']}" if p["error"] else ""
        print(f"plugin {p['name']!r} ({p['distribution'] or 'in-process'}) {p['status']}{detail}")


def _cmd_plugins(args: argparse.Namespace) -> int:
    report = _plugins_report()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hyper-parallel``."""
    parser = argparse.ArgumentParser(
        prog="hyper-parallel",
        description="Muon + AdamW for large-model training, on a plugin registry.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plugins = sub.add_parser(
        "plugins",
        help="list every registered optimizer, LR schedule, partitioner and sharding backend",
        description="List every registered optimizer, LR schedule, partitioner and sharding "
        "backend with its description and the distribution that provides it.",
    )
    plugins.add_argument("--json", action="store_true", help="print machine-readable JSON")
    plugins.set_defaults(handler=_cmd_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
