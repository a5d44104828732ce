"""A small job in a fresh process: sharded_scan's Describe beside pandas' ``df.describe()``, import included.

    python -m bench.small_job                      # 200,000 rows x 8 float64 columns, best of 3
    python -m bench.small_job --against /work/main # also another checkout's sharded_scan, in the same run
    python -m bench.small_job --rows 20000 --repeats 1
    python -m bench.small_job --equations          # also each checkout's step: jaxpr equations, StableHLO lines

Every measurement is one fresh Python process, timed inside it from its first line to the answer:
``import numpy``, the rows loaded from a ``.npy`` file, ``import pandas`` and the frame built (the
same in every process), then either ``df.describe()`` or ``import sharded_scan`` and
``ss.run_with_report(ss.Describe(), df)`` with the default options. ``import ss`` is ``import
ml_dtypes`` (JAX's dtypes; its own column), ``import jax`` (``of it jax``, ml_dtypes included) and
``import sharded_scan``; ``run CPU`` is the run's CPU seconds and ``compiling`` its report's
``compile_seconds`` (tracing included); ``programs``: compiled or loaded, ``cached``: of them from a cache,
``by job``: of them from the job-keyed cache (:mod:`sharded_scan.executables`: neither traced nor compiled).
``CPU-s``: the least over the repeats of the process's CPU seconds from its start to the answer (interpreter
start-up included; XLA compiles on every core, so it can exceed the wall idle), and ``x CPU`` its ratio to pandas':
what holds on a loaded machine, where the walls wait for a core.
``--with-path DIR`` adds a row with ``DIR`` first on the path (another ml_dtypes, say); ``--codegen VALUE`` a row of
this checkout run with ``codegen=VALUE`` (``optimized``: the step on XLA's defaults, as before ``codegen``).
``cold``: the compilation cache is an empty directory (``XDG_CACHE_HOME`` points to a fresh one, so the default
``compilation_cache="auto"`` picks it); ``warm``: a second process on the same directory. Best of
``--repeats`` each (a fresh directory per repeat); the ratios are over pandas' best of the same run. The
target (issue 45, item 5): at most 3x pandas warm and 5x cold.

Every module's bytecode is there before the measured processes, as in an installed package (pip writes it; numpy,
pandas and JAX here have theirs): one unmeasured process of each row, cold then warm, writes the bytecode of every
module it imports into one tree of the run (``PYTHONPYCACHEPREFIX``; the checkouts are not written to), and the
measured processes read it from there. Without it (``--no-bytecode``, what this machine's
``PYTHONDONTWRITEBYTECODE=1`` did to a checkout's own modules before) a process compiles sharded_scan's sources
each time: about 0.25 CPU-s of its import and a run's lazy imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROLOGUE = """\
import time
t0 = time.perf_counter()
import numpy as np
x = np.load({path!r})
import pandas as pd
df = pd.DataFrame(x, columns=[f"c{{i}}" for i in range(x.shape[1])])
"""

_PANDAS = _PROLOGUE + """\
out = df.describe()
seconds = time.perf_counter() - t0
cpu = time.process_time()
import json
print("RESULT", json.dumps({{"seconds": seconds, "cpu": cpu}}))
"""

_SHARDED = _PROLOGUE + """\
t1 = time.perf_counter()
import ml_dtypes
t_ml = time.perf_counter()
import jax
t_jax = time.perf_counter()
import sharded_scan as ss
t2 = time.perf_counter()
from sharded_scan import compile_cache
cpu = time.process_time()
out, report = ss.run_with_report(ss.Describe(), df{options})
seconds = time.perf_counter() - t0
process_cpu = time.process_time()
looked_up, from_cache = compile_cache.counts()[:2]
try:
    from sharded_scan import executables
    loaded = executables.counts().loaded
except ImportError:  # a checkout before the job-keyed cache
    loaded = "-"
import json
print("RESULT", json.dumps({{"seconds": seconds, "import": t2 - t1, "run": seconds - (t2 - t0),
                            "ml_dtypes": t_ml - t1, "jax": t_jax - t1, "run_cpu": process_cpu - cpu, "cpu": process_cpu,
                            "compile": report.compile_seconds, "version": ml_dtypes.__version__,
                            "compiles": looked_up, "from_cache": from_cache, "loaded": loaded}}))
"""


_EQUATIONS = """\
import gc
import json
import time
import numpy as np
import sharded_scan as ss
from sharded_scan.dtypes import x64_scope
from sharded_scan.program import program_for_spec


def count(jaxpr):  # every equation, and those of the jaxprs in its parameters (a sub-jit's at each call)
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                n += count(inner) if hasattr(inner, "eqns") else 0
    return n


spec = ss.sources.ArraySource(np.zeros((1, {cols}))).spec
gc.freeze()  # the phases without a full collection's pause
cpu = time.process_time()
program = program_for_spec(ss.Describe(), spec, {rows}, ss.RunOptions(compilation_cache=None))  # traces the step
with x64_scope(program.spec):
    traced = program.trace_step()
    built = time.process_time()
    lowered = traced.lower()
    done_lowering = time.process_time()
    lowered.compile()
    compiled = time.process_time()
    lines = lowered.as_text(debug_info=False).count("\\n")
print("RESULT", json.dumps({{"equations": count(traced.jaxpr.jaxpr), "stablehlo": lines, "build": built - cpu,
                            "lower": done_lowering - built, "compile": compiled - done_lowering}}))
"""


def _child(code: str, pythonpath: str | None, cache_home: str, pycache: str | None = None,
           write_bytecode: bool = False) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=cache_home)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if pycache:  # every module's bytecode read from (and, warming it, written to) one tree the run owns
        env["PYTHONPYCACHEPREFIX"] = pycache
        if write_bytecode:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False,
                          cwd=cache_home)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--cols", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", action="append", default=[],
                        help="another checkout's root: its sharded_scan measured in the same run (repeatable)")
    parser.add_argument("--with-path", action="append", default=[],
                        help="a row of this checkout with DIR first on PYTHONPATH (e.g. another ml_dtypes)")
    parser.add_argument("--codegen", action="append", default=[],
                        help="a row of this checkout run with codegen=VALUE (auto, optimized, fast_compile)")
    parser.add_argument("--equations", action="store_true",
                        help="also each checkout's Describe step: its jaxpr's equations (those of sub-jaxprs at each "
                             "call) and its StableHLO lines (deterministic), and the least CPU-s over the repeats of "
                             "building the program (the step traced), lowering and compiling it (no cache)")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="every process compiles the Python sources it imports that have no bytecode beside "
                             "them (as under PYTHONDONTWRITEBYTECODE=1 with a checkout never run before)")
    args = parser.parse_args()
    import numpy as np

    checkouts = [("this", ROOT, "")] + [(os.path.basename(os.path.abspath(p)) or p, os.path.abspath(p), "")
                                        for p in args.against]
    checkouts += [(f"+{os.path.basename(os.path.abspath(p))}", f"{os.path.abspath(p)}{os.pathsep}{ROOT}", "")
                  for p in args.with_path]
    checkouts += [(value, ROOT, f", codegen={value!r}") for value in args.codegen]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.npy")
        rng = np.random.default_rng(0)
        np.save(path, rng.standard_normal((args.rows, args.cols)) * 10 + 3)
        pandas_code = _PANDAS.format(path=path)
        pycache = None if args.no_bytecode else os.path.join(tmp, "pycache")
        if pycache:  # one unmeasured process of each row (cold, then warm) writes the bytecode of all it imports
            home = os.path.join(tmp, "bytecode")
            os.makedirs(home)
            _child(pandas_code, None, home, pycache, write_bytecode=True)
            for name, root, options in checkouts:
                home = os.path.join(tmp, f"bytecode-{name}")
                os.makedirs(home)
                for _ in ("cold", "warm"):
                    _child(_SHARDED.format(path=path, options=options), root, home, pycache, write_bytecode=True)
        best: dict[str, dict] = {}
        least_cpu: dict[str, float] = {}  # the least CPU of each row over the repeats (not the fastest's)
        for repeat in range(args.repeats):  # interleaved, so load drifts hit every row alike
            home = os.path.join(tmp, f"pandas{repeat}")
            os.makedirs(home)
            got = _child(pandas_code, None, home, pycache)
            least_cpu["pandas"] = min(least_cpu.get("pandas", float("inf")), got["cpu"])
            if got["seconds"] < best.get("pandas", {"seconds": float("inf")})["seconds"]:
                best["pandas"] = got
            for name, root, options in checkouts:
                home = os.path.join(tmp, f"{name}{repeat}")
                os.makedirs(home)
                for temperature in ("cold", "warm"):
                    got = _child(_SHARDED.format(path=path, options=options), root, home, pycache)
                    key = f"{name} {temperature}"
                    least_cpu[key] = min(least_cpu.get(key, float("inf")), got["cpu"])
                    if got["seconds"] < best.get(key, {"seconds": float("inf")})["seconds"]:
                        best[key] = got
        steps: dict[str, dict] = {}  # --equations: the least CPU-s of each phase over the repeats, interleaved
        for repeat in range(args.repeats if args.equations else 0):
            for name, root, _ in checkouts:
                home = os.path.join(tmp, f"equations-{name}{repeat}")
                os.makedirs(home)
                got = _child(_EQUATIONS.format(rows=args.rows, cols=args.cols), root, home, pycache)
                steps[name] = {k: min(v, steps.get(name, got)[k]) for k, v in got.items()}
    base = best["pandas"]["seconds"]
    print(f"{args.rows:,} rows x {args.cols} float64 columns, a fresh process each, best of {args.repeats}, "
          + ("sources compiled in every process" if args.no_bytecode else "modules' bytecode written before"))
    cpu_base = least_cpu["pandas"]
    print(f"{'':<30}{'seconds':>9}{'x pandas':>10}{'CPU-s':>7}{'x CPU':>7}{'import ss':>11}{'of it jax':>11}"
          f"{'ml_dtypes':>11}{'run':>8}"
          f"{'run CPU':>9}{'compiling':>11}{'programs':>10}{'cached':>8}{'by job':>8}")
    print(f"{'pandas describe()':<30}{base:>9.2f}{1.0:>10.2f}{cpu_base:>7.2f}{1.0:>7.2f}")
    for key, got in best.items():
        if key != "pandas":
            print(f"{'sharded_scan ' + key:<30}{got['seconds']:>9.2f}{got['seconds'] / base:>10.2f}"
                  f"{least_cpu[key]:>7.2f}{least_cpu[key] / cpu_base:>7.2f}"
                  f"{got['import']:>11.2f}{got['jax']:>11.2f}{got['ml_dtypes']:>11.2f}{got['run']:>8.2f}"
                  f"{got['run_cpu']:>9.2f}{got['compile']:>11.2f}{got['compiles']:>10}{got['from_cache']:>8}"
                  f"{got.get('loaded', '-'):>8}")
    versions = sorted({got["version"] for key, got in best.items() if key != "pandas"})
    for name, got in steps.items():
        print(f"{'step of ' + name:<30}{got['equations']:>9} jaxpr equations{got['stablehlo']:>7} StableHLO lines; "
              f"CPU-s: built (traced) {got['build']:.3f}, lowered {got['lower']:.3f}, compiled {got['compile']:.3f}")
    print(f"target: warm <= 3x pandas, cold <= 5x pandas; ml_dtypes {', '.join(versions)} (its import, in 'of it jax', "
          "is the ml_dtypes column)")


if __name__ == "__main__":
    main()
