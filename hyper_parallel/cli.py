"""The ``hyper-parallel`` command line: ``plugins``, ``train``, ``outcome`` and ``checkpoint``."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from hyper_parallel import __version__
from hyper_parallel.core.plugin import OptimizerEntry, PluginKind, get_registry

if TYPE_CHECKING:
    from pathlib import Path

    from hyper_parallel.checkpoint import Verified
    from hyper_parallel.train.config import ConfigField

__all__ = ["main", "run"]


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
                **(
                    {"requires": list(e.requires), "train": e.unusable_in_plain_loop() is None}
                    if isinstance(e, OptimizerEntry)
                    else {}
                ),
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
            if r.get("train") is False:
                aliases += f" (not for train: needs {', '.join(r['requires'])})"
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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _cmd_train(args: argparse.Namespace) -> int:
    from hyper_parallel.train import TrainConfig, train
    from hyper_parallel.train.config import config_fields
    from hyper_parallel.train.loop import main_thread_preemption
    from hyper_parallel.train.outcome import Exit

    given = {f.name: getattr(args, f.name) for f in config_fields() if f.option.on_command_line}
    # SIGTERM is preemption for the whole command, from before the model is built.
    preemption = main_thread_preemption()
    try:
        summary = train(TrainConfig(**given), preemption=preemption)
    except KeyboardInterrupt:  # before the steps began, or while the last files were written
        print("hyper-parallel train: interrupted", file=sys.stderr)
        return int(Exit.INTERRUPTED)
    finally:
        if preemption is not None and preemption.signal is None:
            preemption.uninstall()
        elif preemption is not None:
            # Stopped for it: a later SIGTERM (torchrun's agent stopping the other ranks once
            # one exited 143) finds the process on its way out with 143. SIG_IGN, not a Python
            # handler: the interpreter resets those to the default while it shuts down.
            for sig in preemption.signals:
                signal.signal(sig, signal.SIG_IGN)
    return _exit_code(list(summary["runs"].values()))


def _exit_code(runs: list[dict[str, Any]]) -> int:
    """The code of the first run that stopped early, its one line on stderr (rank 0), else 0."""
    from hyper_parallel.train.outcome import exit_code, stop_line

    line = stop_line(runs)
    if line is not None and os.environ.get("RANK", "0") == "0":
        print(f"hyper-parallel train: {line}", file=sys.stderr)
    return int(exit_code(runs))


def _cmd_outcome(args: argparse.Namespace) -> int:
    """How the run in ``args.out`` ended, in one line; its exit code is the run's own."""
    import json
    from pathlib import Path

    from hyper_parallel.train.outcome import Exit, exit_code

    path = Path(args.out) / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        runs = list(summary["runs"].values())
        code = Exit(summary.get("exit_code", exit_code(runs)))
        steps = ", ".join(
            f"{r.get('label', n)} {r['steps']} steps" for n, r in summary["runs"].items()
        )
    except FileNotFoundError:
        print(
            f"failed: {path} does not exist: the run ended before writing it (a crash, or a "
            "worker that raised), or is still running",
            flush=True,
        )
        return int(Exit.SAVE_FAILED)
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        _fail(f"outcome: {path} is not a summary of hyper-parallel train ({exc!r})")
    said = {
        Exit.FINISHED: "finished",
        Exit.PREEMPTED: "preempted: requeue it with --resume",
        Exit.INTERRUPTED: "interrupted (Ctrl-C)",
        Exit.SAVE_FAILED: "failed: a checkpoint could not be saved",
        Exit.NON_FINITE: "failed: NaN/Inf",
    }.get(code, code.name.lower())
    print(f"{said} ({steps}); exit code {int(code)}", flush=True)
    return int(code)


def _is_symlink_loop(path: Path) -> bool:
    """Whether following ``path`` fails because its links lead round in a loop."""
    import errno

    try:
        path.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _cmd_checkpoint_verify(args: argparse.Namespace) -> int:
    """One line per checkpoint at or under ``args.path``; 1 if any is bad or corrupt."""
    from pathlib import Path

    from hyper_parallel.checkpoint import verify
    from hyper_parallel.checkpoint._verify import find_checkpoints

    root = Path(args.path)
    if not root.exists():
        if root.is_symlink() and _is_symlink_loop(root):
            _fail(
                f"checkpoint verify: {root} is a symlink loop (following it leads back to "
                "itself); point it at a checkpoint or a folder of them"
            )
        _fail(f"checkpoint verify: {root} does not exist; give a checkpoint or a folder of them")
    found = find_checkpoints(root)
    if not found:
        _fail(f"checkpoint verify: no checkpoint at or under {root}")
    counts = {"intact": 0, "unverified": 0, "bad": 0, "corrupt": 0}
    for path in found:
        checked = verify(path)
        counts[_verdict(checked)] += 1
        print(checked.line(), flush=True)
    if len(found) > 1:
        print(
            ", ".join(f"{n} {verdict}" for verdict, n in counts.items() if n or verdict == "intact")
        )
    return 1 if counts["bad"] or counts["corrupt"] else 0


def _verdict(checked: Verified) -> str:
    """How ``checkpoint verify`` counts a checkpoint: never "intact" without checksums."""
    if checked.non_finite:
        return "bad"
    if not checked.ok:
        return "corrupt"
    return "intact" if checked.intact else "unverified"


def _cmd_checkpoint_unlock(args: argparse.Namespace) -> int:
    """Take over the lock of ``args.path`` from a dead holder; one line says what was done."""
    from hyper_parallel.checkpoint import break_lock

    print(break_lock(args.path, dead_host=args.dead_host), flush=True)
    return 0


def _add_checkpoint_parser(sub: Any) -> None:
    """``checkpoint verify PATH`` and ``checkpoint unlock DIR --dead-host HOST``."""
    parser = sub.add_parser(
        "checkpoint",
        help="check checkpoints",
        description="Work with hyper_parallel checkpoints.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify",
        help="check every file of a checkpoint (or of every checkpoint under a folder) against "
        "its manifest",
        description="Check every file of a checkpoint, or of every checkpoint under a folder, "
        "against the sizes and checksums its manifest recorded, then read every tensor back "
        "and check it for NaN and Inf. Prints one line per checkpoint (ok, ok? for one saved "
        "without checksums, BAD, CORRUPT); exits 1 if any is bad or corrupt.",
    )
    verify.add_argument("path", metavar="PATH", help="a checkpoint, or a folder of them")
    verify.set_defaults(handler=_cmd_checkpoint_verify)
    unlock = actions.add_parser(
        "unlock",
        help="take over a folder's lock from a run on a host that is down",
        description="Take over the lock of a checkpoint folder (DIR/.lock) from a run on a host "
        "that is down, where the file system keeps the lock for it (NFS). Give the host the "
        "lock names as --dead-host, after checking that it is down: naming a host that still "
        "runs lets two runs write to one folder. A lock held on this host is never taken over: "
        "stop its process.",
    )
    unlock.add_argument(
        "path",
        metavar="DIR",
        help="the folder holding .lock: a run's folder under --checkpoint-dir, such as "
        "ckpt/muon_adamw",
    )
    unlock.add_argument(
        "--dead-host",
        metavar="HOST",
        help="the host the lock names, which you have checked is down",
    )
    unlock.set_defaults(handler=_cmd_checkpoint_unlock)


def _add_train_parser(sub: Any) -> None:
    """``train``: one flag per :class:`~hyper_parallel.train.TrainConfig` field."""
    from hyper_parallel.train.config import config_fields, optimizers_train_cannot_use

    parser = sub.add_parser(
        "train",
        help="train a small GPT with Muon + AdamW (or any registered optimizer) and plot the loss",
        description="Train a small GPT-style decoder on a built-in synthetic language (generated "
        "at run time), on real text (--data python-stdlib: this Python's standard library), or "
        "on --data FILE, and write metrics.jsonl, loss_curves.png and summary.json.",
    )
    refused = ", ".join(f"{name} ({why})" for name, why in optimizers_train_cannot_use().items())
    for f in config_fields():
        if f.option.on_command_line:
            text = f.option.help
            if f.name == "optimizer" and refused:
                text += f"; train cannot use {refused}"
            parser.add_argument(f.flag, dest=f.name, help=text, **_parsing(f))
    parser.set_defaults(handler=_cmd_train)


def _parsing(f: ConfigField) -> dict[str, Any]:
    """How argparse reads ``f``: a switch for a bool, else a value of the field's type."""
    if f.type is bool:
        return {"action": "store_false" if f.default else "store_true"}
    return {
        "type": _positive_int if f.option.positive else f.type,
        "default": f.default,
        "metavar": f.option.metavar,
        "choices": f.option.choices,
    }


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
    outcome = sub.add_parser(
        "outcome",
        help="say how the run in OUT ended, and exit with its exit code (143: preempted)",
        description="Read OUT/summary.json and say how that run of hyper-parallel train ended, "
        "exiting with the code the run exited with: 0 finished, 1 a checkpoint could not be "
        "saved (or no summary: the run crashed), 3 NaN/Inf, 130 Ctrl-C, 143 preempted. Under "
        "torchrun, whose own exit code is 1 whenever a worker exits non-zero, a job script "
        "asks this to tell a preempted run (requeue) from a failed one.",
    )
    outcome.add_argument("out", metavar="OUT", help="the run's --out folder")
    outcome.set_defaults(handler=_cmd_outcome)
    _add_checkpoint_parser(sub)
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
    formatting, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return int(args.handler(args))
    except (TrainError, DataError, HyperParallelError) as exc:
        _fail(str(exc))
    except BrokenPipeError:
        # The reader left (`hyper-parallel plugins | head`): stop quietly, as Unix tools do.
        # stdout is pointed at /dev/null, so flushing it at exit raises nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe stopped
    except RuntimeError as exc:  # torch.distributed's errors are RuntimeErrors
        if (lost := _peer_lost(exc)) is None:
            raise
        print(f"hyper-parallel: error: {lost}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatting


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """A warning as the command line prints it: one line, without Python's source line."""
    return f"hyper-parallel: warning: {' '.join(str(message).split())}\n"


#: What gloo and NCCL say when the process at the other end of a connection is gone.
_PEER_GONE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote process exit|Connection refused",
    flags=re.IGNORECASE,
)


def _peer_lost(exc: RuntimeError) -> str | None:
    """One line for a torchrun worker whose peer process died under it; ``None`` otherwise."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "RANK" not in os.environ or not _PEER_GONE.search(first):
        return None
    said = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]
    return (
        f"rank {os.environ['RANK']}: another process of this job stopped, so this one cannot go "
        f"on ({said}); that process's own output says why"
    )


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``hyper-parallel`` program: :func:`main`, then exit with its code.

    A torchrun worker leaves without the interpreter's finalization once its
    output is flushed: gloo's native threads can abort a process there
    (SIGABRT, "terminate called without an active exception") after its work
    is done and saved, and torchrun would report that finished run as failed.
    A preempted process leaves the same way, so that its exit follows the
    save at once, well inside the grace period before SIGKILL: its files are
    written and closed by then, and finalization would only cost time.
    """
    from hyper_parallel.train.outcome import Exit

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    if "LOCAL_RANK" not in os.environ and code != Exit.PREEMPTED:
        raise SystemExit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
