"""``hyper-parallel plugins`` lists every built-in with its source."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

import hyper_parallel
from hyper_parallel import get_registry
from hyper_parallel.cli import main


def test_plugins_json_lists_every_registered_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    listed = {(e["kind"], e["name"]) for e in report["entries"]}
    assert listed == {(e.kind.value, e.name) for e in get_registry().entries()}
    muon = next(e for e in report["entries"] if e["name"] == "muon")
    assert (
        muon["plugin"] == "muon"
        and muon["distribution"] == f"hyper-parallel {hyper_parallel.__version__}"
    )
    assert muon["description"]
    assert {p["name"] for p in report["plugins"] if p["status"] == "loaded"} >= {
        "muon",
        "schedules",
        "partitioners",
    }


def test_plugins_table_via_the_console_script() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hyper_parallel", "plugins"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for heading in ("optimizers (", "LR schedules (", "partitioners (", "sharding backends ("):
        assert heading in out
    entries = get_registry().entries()
    assert any(e.distribution == f"hyper-parallel {hyper_parallel.__version__}" for e in entries)
    for entry in entries:
        line = next(line for line in out.splitlines() if line.strip().startswith(entry.name + " "))
        assert f"[{entry.plugin} from {entry.distribution or 'registered in-process'}]" in line


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plugin"])
    assert info.value.code == 2
    assert "invalid choice: 'plugin'" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """``hyper-parallel plugins | head -1``: the pipe closes after one line."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hyper_parallel.cli import main\n"
        "sys.stdin.readline()\n"  # wait for the reader to be gone
        "raise SystemExit(main(['plugins']))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdin is not None
    process.stdout.close()  # the reader leaves before anything is written
    process.stdin.write("go\n")
    process.stdin.close()
    assert process.stderr is not None
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_a_peer_that_died_is_one_line_naming_this_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyper_parallel import cli

    said = (
        "[/src/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:21378: Connection reset "
        "by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )

    def handler(args: argparse.Namespace) -> int:
        raise RuntimeError(said)  # what a gloo collective raises when its peer process is gone

    parser = argparse.ArgumentParser()
    parser.set_defaults(handler=handler)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setenv("RANK", "3")
    assert cli.main([]) == 1
    assert capsys.readouterr().err == (
        "hyper-parallel: error: rank 3: another process of this job stopped, so this one cannot "
        "go on (Read error [127.0.0.1]:21378: Connection reset by peer); that process's own "
        "output says why\n"
    )
    monkeypatch.delenv("RANK")  # not a torchrun worker: the error is not ours to explain
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        cli.main([])


def _option_helps(text: str) -> dict[str, str]:
    """Each option of an argparse help text: its flags, and its help joined into one line."""
    helps: dict[str, str] = {}
    flags = ""
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flags, _, said = line.strip().partition("  ")
            helps[flags] = said.strip()
        elif line.strip() and flags:
            helps[flags] = f"{helps[flags]} {line.strip()}".strip()
    return helps


def test_every_train_option_is_explained_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    helps = _option_helps(capsys.readouterr().out)
    assert {"--weight-decay WEIGHT_DECAY", "--seed SEED", "--threads N"} <= set(helps)
    for flags, said in helps.items():
        words = re.sub(r"\(default: [^)]*\)", "", said).split()
        assert len(words) >= 2, f"{flags} has no help of its own: {said!r}"
    # no run of 8 words said under two options (a paragraph repeated)
    runs: dict[str, str] = {}
    for flags, said in helps.items():
        words = said.split()
        for i in range(len(words) - 7):
            run = " ".join(words[i : i + 8])
            assert runs.setdefault(run, flags) == flags, f"{flags} repeats {runs[run]}: {run!r}"
