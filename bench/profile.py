"""Where a workload's step spends its time: the compiled step's HLO and a jax.profiler trace.

    python bench/profile.py gram_d32 moments_d256     # writes bench/results/profiles/NAME.*

For each workload: ``NAME.hlo.txt`` is the optimized HLO of the compiled step (what XLA
runs per call: look inside the ``while`` body for the per-micro-batch work), and
``NAME.summary.txt`` lists that body's instructions with the bytes they touch per
micro-batch; ``trace/`` holds a ``jax.profiler`` trace of one default run
(open it with TensorBoard or Perfetto).
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import sharded_scan as ss  # noqa: E402
from bench.run import RESULTS  # noqa: E402
from bench.workloads import make_workloads  # noqa: E402
from sharded_scan.program import build_program  # noqa: E402
from sharded_scan.sources import as_source  # noqa: E402

COMBINERS = {"gram": ss.Gram, "moments": ss.Moments, "linreg": ss.LinearRegression}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (fusion|dot|reduce|while|conditional|copy)\(", re.M)


def main(names: list[str]) -> None:
    out = RESULTS / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    for w in make_workloads(64, set(names)):
        data = w.x if w.y is None else (w.x, w.y)
        prog = build_program(COMBINERS[w.kind](), as_source(data), ss.RunOptions())
        layout = prog.layout
        text = prog.lower_step().compile().as_text()
        (out / f"{w.name}.hlo.txt").write_text(text)
        ops = INSTRUCTION.findall(text)
        lines = [f"{w.name}: microbatch={layout.microbatch} steps_per_call={layout.steps_per_call}"]
        lines += [f"  {kind:12s} {shape:28s} {name}" for name, shape, kind in ops]
        (out / f"{w.name}.summary.txt").write_text("\n".join(lines) + "\n")
        ss.run(COMBINERS[w.kind](), data)
        with jax.profiler.trace(str(out / "trace" / w.name)):
            ss.run(COMBINERS[w.kind](), data)
        print("\n".join(lines[:40]))


if __name__ == "__main__":
    main(sys.argv[1:] or ["gram_d32", "moments_d256"])
