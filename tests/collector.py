"""Python's cycle collector set for the suite's processes: fewer full collections.

JAX's tracing makes many short-lived objects, so CPython's default thresholds (700, 10, 10) run a collection of
the youngest generation every few hundred of them and, every so often, one of the whole heap, which holds every
module imported and JAX's caches of programs: 0.2-0.5 s of CPU each in a test process, a tenth of its CPU
(tests/test_statistics.py and four other modules in one process: 12.4 of 127 CPU-s). ``fewer_collections`` runs
them a few times less often (7.7 of 125 CPU-s there, the same peak memory): what is collected stays the same, garbage
cycles, a little later. ``freeze`` moves everything alive now (modules, functions) out of the collector's sight for
good: for the processes the suite starts (the pytest processes do not freeze: ``gc.get_objects`` would not see
frozen objects, and tests/test_fixed_order.py looks there). The library leaves the collector as Python sets it.
"""

import gc

THRESHOLDS = (10_000, 10, 10)


def fewer_collections() -> None:
    gc.set_threshold(*THRESHOLDS)


def freeze() -> None:
    """Everything alive now (the imports done) is never scanned again: call once the imports are done."""
    gc.freeze()
