"""The ``hyper-parallel`` command line: ``plugins`` and ``train``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hyper_parallel import __version__
from hyper_parallel.core.plugin import PluginKind, get_registry

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (the command and the problem), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _cmd_train(args: argparse.Namespace) -> int:
    from hyper_parallel.train import TrainConfig, train

    fields = (
        "optimizer", "compare", "partitioner", "scheduler", "steps", "warmup_steps", "lr", "muon_lr",
        "weight_decay", "batch_size", "seq_len", "dim", "layers", "heads", "tied_embeddings",
        "eval_every", "seed", "data", "tokenizer", "out", "sharding",
        "checkpoint_dir", "checkpoint_every", "resume",
    )  # fmt: skip
    config = TrainConfig(**{k: getattr(args, k) for k in fields}, progress=not args.no_progress)
    summary = train(config)
    interrupted = any(run["interrupted"] for run in summary["runs"].values())
    return 130 if interrupted else 0


def _add_train_parser(sub: Any) -> None:
    from hyper_parallel.train import MUON_ADAMW, TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a small GPT with Muon + AdamW (or any registered optimizer) and plot the loss",
        description="Train a small GPT-style decoder on a built-in synthetic language (generated "
        "at run time) or on --data, and write metrics.jsonl, loss_curves.png and summary.json.",
    )
    p.add_argument(
        "--optimizer",
        default=d.optimizer,
        help=f"'{MUON_ADAMW}' (default), or any registered optimizer name",
    )
    p.add_argument(
        "--compare",
        metavar="NAME",
        help="also train with this optimizer and plot both (e.g. adamw)",
    )
    p.add_argument(
        "--partitioner",
        default=d.partitioner,
        help=f"how {MUON_ADAMW} splits params (default: %(default)s)",
    )
    p.add_argument(
        "--scheduler", default=d.scheduler, help="LR schedule name (default: %(default)s)"
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=d.steps,
        help="optimizer steps (default: %(default)s)",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="warmup steps (default: 5%% of --steps)"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        help="AdamW's peak lr, or the single optimizer's (default: %(default)s)",
    )
    p.add_argument(
        "--muon-lr", type=float, default=d.muon_lr, help="Muon's peak lr (default: %(default)s)"
    )
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="(default: %(default)s)"
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=d.batch_size, help="(default: %(default)s)"
    )
    p.add_argument(
        "--seq-len", type=_positive_int, default=d.seq_len, help="(default: %(default)s)"
    )
    p.add_argument(
        "--dim", type=_positive_int, default=d.dim, help="model width (default: %(default)s)"
    )
    p.add_argument(
        "--layers",
        type=_positive_int,
        default=d.layers,
        help="decoder blocks (default: %(default)s)",
    )
    p.add_argument(
        "--heads",
        type=_positive_int,
        default=d.heads,
        help="attention heads (default: %(default)s)",
    )
    p.add_argument(
        "--tied-embeddings", action="store_true", help="share the embedding and lm_head weights"
    )
    p.add_argument(
        "--eval-every",
        type=_positive_int,
        default=d.eval_every,
        help="validation interval in steps (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    p.add_argument(
        "--data", type=Path, help="train on this UTF-8 text file instead of the built-in data"
    )
    p.add_argument(
        "--tokenizer",
        choices=("char", "byte"),
        default=d.tokenizer,
        help="for --data (default: %(default)s)",
    )
    p.add_argument(
        "--out", type=Path, default=d.out, help="output directory (default: %(default)s)"
    )
    p.add_argument(
        "--sharding",
        help="shard the model with this backend (fsdp, hsdp); run under torchrun, e.g. "
        "torchrun --nproc_per_node 2 -m hyper_parallel train --sharding fsdp",
    )
    p.add_argument("--checkpoint-dir", type=Path, help="save checkpoints here (one folder per run)")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="N",
        help="also save every N steps (default: only at the end)",
    )  # fmt: skip
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_cmd_train)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hyper-parallel``."""
    parser = _Parser(
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
    _add_train_parser(sub)
    return parser


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2, like argparse's own usage errors."""
    print(f"hyper-parallel: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    from hyper_parallel.core.errors import HyperParallelError
    from hyper_parallel.train import DataError, TrainError

    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (TrainError, DataError, HyperParallelError) as exc:
        _fail(str(exc))


if __name__ == "__main__":
    raise SystemExit(main())
