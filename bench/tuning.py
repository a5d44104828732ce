"""Measurements behind the engine's defaults: the tuning sweep, host overhead, communication.

- :func:`sweep`: Gram rate over ``microbatch`` x ``steps_per_call`` at the default block,
  then over the block size at the best of those, for d in {32, 256, 1024}.
- :func:`host_overhead`: the share of a default ``run`` spent outside the compiled steps
  (reading, placing, dispatch, merge, finalize).
- :func:`communication`: collectives in the compiled step and merge, and the bytes each
  device contributes to the one merge.
"""

from __future__ import annotations

import re
import time

import jax
import numpy as np

import sharded_scan as ss
from bench.workloads import aligned_rows, rows_for
from sharded_scan.combiners.statistics.sums import default_block
from sharded_scan.layout import resolve_chunking
from sharded_scan.prefetch import device_batches
from sharded_scan.program import build_program, program_for_spec
from sharded_scan.sources import Source

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)(?:-start)?\(")


def interleaved_best(calls: dict, repeats: int, cpu: dict | None = None) -> dict[str, float]:
    """Best wall time of each call over ``repeats`` rounds, one call of each per round; ``cpu``: a dict given
    also gets each call's best process CPU seconds (every thread's: on a shared machine they hold better)."""
    best = dict.fromkeys(calls, float("inf"))
    if cpu is not None:
        cpu.update(dict.fromkeys(calls, float("inf")))
    for _ in range(repeats):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
            if cpu is not None:
                cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    return best


def _gram_rates(x: np.ndarray, configs: list[tuple[int, int, int]], repeats: int) -> list[dict]:
    calls = {
        cfg: (lambda mb=cfg[0], spc=cfg[1], b=cfg[2]: ss.run(ss.Gram(block=b), x, microbatch=mb, steps_per_call=spc))
        for cfg in configs
    }
    for call in calls.values():
        call()  # compile
    seconds = interleaved_best(calls, repeats)
    n, d = x.shape
    return [
        {"d": d, "microbatch": mb, "steps_per_call": spc, "block": b, "gflops": 2.0 * n * d * d / t / 1e9}
        for (mb, spc, b), t in seconds.items()
    ]


def sweep(quick: bool, repeats: int) -> dict:
    """Gram rate by (microbatch, steps_per_call), then by block; 64 MiB (quick: 16 MiB)."""
    widths = (256,) if quick else (32, 256, 1024)
    out = {"megabytes": 8 if quick else 64, "points": [], "best": {}}
    for d in widths:
        x = aligned_rows(rows_for(out["megabytes"], d, 8 * 4096), d, seed=7)
        block = default_block(d)
        mb0, spc0 = resolve_chunking(jax.ShapeDtypeStruct((d,), np.float32))
        microbatches = (mb0 // 4, mb0) if quick else (mb0 // 4, mb0, mb0 * 4)
        steps = (spc0,) if quick else sorted({2, 8, 32, spc0})
        points = _gram_rates(x, [(mb, s, block) for mb in microbatches for s in steps], repeats)
        top = max(points, key=lambda p: p["gflops"])
        blocks = sorted({b for b in (32, 64, 128, 256, 512, d) if b <= d} - {block})
        if quick:
            blocks = blocks[-2:]
        points += _gram_rates(x, [(top["microbatch"], top["steps_per_call"], b) for b in blocks], repeats)
        out["points"] += points
        out["best"][str(d)] = max(points, key=lambda p: p["gflops"])
    out["defaults"] = {}
    for d in widths:
        microbatch, steps = resolve_chunking(jax.ShapeDtypeStruct((d,), np.float32))
        out["defaults"][str(d)] = dict(microbatch=microbatch, steps_per_call=steps, block=default_block(d))
    return out


class RepeatSource(Source):
    """``steps`` steps whose rows all come from one step's worth of ``rows`` (no extra memory)."""

    def __init__(self, rows: np.ndarray, steps: int):
        self.rows, self.steps = rows, steps

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0] * self.steps

    @property
    def spec(self):
        return jax.ShapeDtypeStruct(self.rows.shape[1:], self.rows.dtype)

    def read(self, start: int, stop: int):
        offset = start // self.rows.shape[0] * self.rows.shape[0]
        return self.rows[start - offset : stop - offset]


def host_overhead(quick: bool) -> list[dict]:
    """Host time per step of the default ``run`` loop against the compiled step's time.

    ``run``'s loop (read the rows, place them, dispatch the step) is timed to the last
    step's end, and the compiled step alone on a batch already on the devices; host
    overhead is what the loop adds per step. (On XLA's CPU client a step's dispatch
    waits for the devices, so the host part is not hidden behind compute.)
    """
    out = []
    steps = 3 if quick else 8
    for d in (256,) if quick else (32, 256, 1024):
        spec = jax.ShapeDtypeStruct((d,), np.float32)
        mb, spc = resolve_chunking(spec)
        rows = aligned_rows(ss.make_mesh(None).shape["data"] * mb * spc, d, seed=8)
        source = RepeatSource(rows, steps)
        prog = build_program(ss.Gram(), source, ss.RunOptions(microbatch=mb, steps_per_call=spc))
        placed = next(device_batches(source, prog.layout, prog.mesh, 0, 0))

        def compiled(prog=prog, placed=placed):
            partials = prog.init()
            jax.block_until_ready(partials)
            start = time.perf_counter()
            for _ in range(steps):
                partials = prog.step(partials, placed.batch, placed.num_valid)
            jax.block_until_ready(partials)
            return time.perf_counter() - start

        def host(prog=prog, source=source):
            partials = prog.init()
            jax.block_until_ready(partials)
            start = time.perf_counter()
            for item in device_batches(source, prog.layout, prog.mesh, 0, 2):
                partials = prog.step(partials, item.batch, item.num_valid)
            jax.block_until_ready(partials)
            return time.perf_counter() - start

        compiled(), host()
        timings = interleaved_best({"compiled": compiled, "loop": host}, 3)
        step_s, loop_s = timings["compiled"] / steps, timings["loop"] / steps
        host_s = max(loop_s - step_s, 0.0)
        out.append({
            "d": d, "microbatch": mb, "steps_per_call": spc, "steps": steps,
            "step_seconds": step_s, "loop_seconds_per_step": loop_s, "host_seconds_per_step": host_s,
            "host_share": host_s / step_s,
        })
    return out


def _squared_error(params, batch):
    features, target = batch
    return (features @ params - target) ** 2


def gradient_iterations(quick: bool, repeats: int) -> dict:
    """Seconds per full-batch gradient iteration (200,000 x 16 rows on 4 devices; quick: 50,000):
    a new ``params`` value each iteration against rerunning the same combiner.

    ``params`` are operands of the compiled programs, so a new value compiles nothing.
    """
    n = 50_000 if quick else 200_000
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(n, 16)).astype(np.float32), rng.normal(size=n).astype(np.float32)
    same = ss.Gradient(_squared_error, np.zeros(16, np.float32))
    steps = iter(range(1 << 30))

    def new_params():
        ss.run(ss.Gradient(_squared_error, np.full(16, next(steps), np.float32)), (x, y), mesh="data:4")

    calls = {"new params": new_params, "same combiner": lambda: ss.run(same, (x, y), mesh="data:4")}
    for call in calls.values():
        call()  # compile
    seconds = interleaved_best(calls, repeats)
    return {"rows": n, "seconds": seconds, "ratio": seconds["new params"] / seconds["same combiner"]}


def logical_shards_cost(quick: bool, repeats: int) -> list[dict]:
    """Seconds of a run with ``logical_shards=8`` (micro-batches of at most 256 rows, the same
    on every device and process split) against the default run, on the same data."""
    out = []
    megabytes = 16 if quick else 64
    for name, make, d in (("Gram", ss.Gram, 32), ("Gram", ss.Gram, 256), ("Covariance", ss.Covariance, 256)):
        x = aligned_rows(rows_for(megabytes, d, 8 * 4096), d, seed=9)
        calls = {
            "default": lambda make=make, x=x: ss.run(make(), x),
            "logical_shards=8": lambda make=make, x=x: ss.run(make(), x, logical_shards=8),
        }
        for call in calls.values():
            call()  # compile
        seconds = interleaved_best(calls, repeats)
        out.append({"combiner": name, "d": d, "rows": len(x), "seconds": seconds,
                    "ratio": seconds["logical_shards=8"] / seconds["default"]})
    return out


def _bytes_per_device(tree) -> int:
    return int(sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)))


def communication() -> list[dict]:
    """Collectives of the compiled step and merge, and the merge's bytes per device."""
    cases = [
        ("Gram d=256", ss.Gram(), jax.ShapeDtypeStruct((256,), np.float32), "data:8"),
        ("Gram d=256 (dense)", ss.Gram(block=256), jax.ShapeDtypeStruct((256,), np.float32), "data:8"),
        ("Gram d=1024", ss.Gram(), jax.ShapeDtypeStruct((1024,), np.float32), "data:8"),
        ("Gram d=1024 wide", ss.Gram(), jax.ShapeDtypeStruct((1024,), np.float32), "data:4,model:2"),
        ("Moments d=256", ss.Moments(), jax.ShapeDtypeStruct((256,), np.float32), "data:8"),
        (
            "LinearRegression d=256",
            ss.LinearRegression(),
            (jax.ShapeDtypeStruct((256,), np.float32), jax.ShapeDtypeStruct((), np.float32)),
            "data:8",
        ),
    ]
    out = []
    for name, combiner, spec, mesh_spec in cases:
        prog = program_for_spec(combiner, spec, 1 << 20, ss.RunOptions(mesh=mesh_spec))
        partials = prog.init()
        step = prog.lower_step().compile().as_text()
        merge = prog.lower_merge().compile().as_text()
        out.append({
            "case": name, "mesh": mesh_spec,
            "step_collectives": COLLECTIVE.findall(step), "merge_collectives": COLLECTIVE.findall(merge),
            "merge_bytes_per_device": _bytes_per_device(partials),
        })
    return out


def describe(result: dict, overhead: list[dict]) -> str:
    lines = ["tuning sweep (Gram, GFLOP/s effective; best point per d):"]
    for d, p in result["best"].items():
        want = result["defaults"][d]
        at_default = [
            q["gflops"] for q in result["points"]
            if q["d"] == int(d) and all(q[k] == want[k] for k in ("microbatch", "steps_per_call", "block"))
        ]
        default = f"{at_default[0]:.0f} at the defaults" if at_default else "defaults not in the sweep"
        lines.append(
            f"  d={d}: {p['gflops']:.0f} at microbatch={p['microbatch']} steps_per_call={p['steps_per_call']} "
            f"block={p['block']}; {default}"
        )
    for o in overhead:
        lines.append(
            f"  host overhead d={o['d']}: {o['host_share']:.1%} of the step time "
            f"({o['host_seconds_per_step'] * 1e3:.2f} ms/step on the host, "
            f"{o['step_seconds'] * 1e3:.2f} ms compiled step)"
        )
    return "\n".join(lines)
