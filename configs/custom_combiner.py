"""Your own combiner, run from the CLI: the share of each column's values above a threshold.

    python -m launch.main --config=custom_combiner --workdir=/tmp/ss_runs/above
    python -m launch.main --config=custom_combiner:quick --workdir=/tmp/ss_runs/above_quick \
        --config.combiner.kwargs.threshold=1.5 --jax_num_cpu_devices=8

A template for your own: ``ExceedanceRate`` is a ``Combiner``, and a Combiner is four
functions, ``init``, ``add``, ``merge``, ``finalize`` (``AdditiveCombiner`` gives the
``merge``); the hooks (``check_spec``, ``fingerprint``, ``for_mesh``/``partition``...)
have defaults, and nothing of how the engine runs it is yours to write. This config names it by
``module:Class`` with its arguments in ``kwargs``, as ``--config.combiner.name=my_pkg.stats:MyCombiner
--config.combiner.kwargs.NAME=VALUE`` names yours on any config. Its counts are exact
``wide`` integers, so they do not wrap at 2^31 rows.
"""

import dataclasses

import numpy as np

import sharded_scan as ss
from configs.common import base_config
from sharded_scan.combiners import wide


@dataclasses.dataclass(frozen=True)  # equal settings compile once; the fields name the job in checkpoints
class ExceedanceRate(ss.AdditiveCombiner):
    """Per column, the fraction of rows whose value is above ``threshold`` (NaN is not above)."""

    threshold: float = 0.0

    def init(self, spec):
        return {"above": wide.zeros(spec.shape), "rows": wide.zeros()}

    def add(self, acc, batch, mask):
        above = wide.sum_rows(batch > self.threshold, mask)
        return {"above": wide.add(acc["above"], above), "rows": wide.count_rows(acc["rows"], mask)}

    def finalize(self, acc):
        return wide.to_int(acc["above"]) / np.maximum(wide.to_int(acc["rows"]), 1)


def get_config(arg=None):
    return base_config("configs.custom_combiner:ExceedanceRate", {"threshold": 1.0}, arg, num_rows=1_000_000,
                       features=16)
