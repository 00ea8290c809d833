"""``python -m benchmarks``: run the suite and print the table."""

from benchmarks.suite import main

raise SystemExit(main())
