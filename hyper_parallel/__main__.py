"""``python -m hyper_parallel`` runs the command-line interface."""

from hyper_parallel.cli import run

run()
