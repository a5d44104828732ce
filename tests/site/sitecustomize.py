"""Read by every Python process the suite starts through ``tests/cli.py``'s environment (launcher runs, their
processes, docs blocks): fewer cycle collections, as in the suite's own processes (tests/collector.py), about 0.2 s
of CPU less a launcher process. Nothing else: what these processes compute and print is the same."""

import gc

gc.set_threshold(10_000, 10, 10)  # tests/collector.py's THRESHOLDS
