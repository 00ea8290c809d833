"""Time Muon steps with whichever ``hyper_parallel`` is first on ``sys.path``.

Run by path, never as ``benchmarks.step_timer``: ``--cases against`` starts it
once with this checkout and once with another on ``PYTHONPATH``, so it
imports nothing from ``benchmarks`` and only what every version exports
(``hyper_parallel.Muon``). It prints the median step time in seconds.

    python benchmarks/step_timer.py 64x64*400 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _shapes(spec: str) -> list[tuple[int, int]]:
    """``"512x512*4,2048x512*2"`` -> the shapes, each repeated as many times as it says."""
    shapes = []
    for part in spec.split(","):
        shape, _, count = part.partition("*")
        rows, cols = (int(n) for n in shape.split("x"))
        shapes += [(rows, cols)] * int(count or 1)
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", help='matrix shapes, e.g. "64x64*400"')
    parser.add_argument("--repeats", type=int, default=10, help="timed steps")
    args = parser.parse_args()
    from hyper_parallel import Muon

    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in _shapes(args.shapes)
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer = Muon(params, lr=0.02)
    for _ in range(3):  # plans, paths and buffers are made here
        optimizer.step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    print(statistics.median(times))


if __name__ == "__main__":
    main()
