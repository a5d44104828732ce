"""Eight simulated CPU devices for every test in this process."""

import jax

jax.config.update("jax_num_cpu_devices", 8)


# The longest tests first: under `-n 2` the other worker runs the rest beside them.
LONGEST_FIRST = (
    "tests/test_reproducible.py", "tests/test_certified.py", "tests/test_faults.py", "tests/test_dead_peer.py",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
