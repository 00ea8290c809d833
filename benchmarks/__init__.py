"""hyper_parallel's benchmarks: ``python -m benchmarks`` (see :mod:`benchmarks.suite`)."""
