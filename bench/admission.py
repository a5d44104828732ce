"""Memory admission against the real peak: what the estimate says, what a run takes.

    python bench/admission.py            # Histogram, Quantiles, TopK, Gram at 3 sizes each (~1 min)
    python bench/admission.py --large    # sizes up to a few GiB (several minutes; needs the memory)
    python bench/admission.py --devices 4

Each job runs in a fresh child process (``--child``): it makes its rows, builds the
program, asks :func:`sharded_scan.admission.memory_need` what it needs of the available
memory, resets the high-water mark (``/proc/self/clear_refs``), runs, and reports how far
``VmHWM`` rose above the RSS before the run: the job's own peak, beside the estimate
(``est/peak`` at least 1: the estimate covers it; the smallest jobs' estimates are mostly
``admission.RUNTIME``, XLA's compiler and runtime).

Then the container case, in a 1 GiB memory cgroup: a Histogram whose estimate exceeds the
room left must stop in one line before compute, and a smaller one must run. Where this
process may make a cgroup (root, a writable v1 or v2 memory controller) the children run
inside a real one; otherwise (``--fake-cgroup`` forces it) they read a fake cgroup v2 tree
(``admission.FS_ROOT``) that says the same.

Prints the table and writes ``bench/results/admission[_large].json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's sharded_scan, not an installed one

RESULTS = ROOT / "bench" / "results"
MIB = 1 << 20
ROWS = 100_000
# combiner: (what its size is, columns of X (Gram: the size), sizes, --large sizes)
CASES = {
    "Histogram": ("bins", 8, (10_000, 100_000, 400_000), (1_000_000, 2_000_000, 4_000_000)),
    "Quantiles": ("k", 4, (200, 2_000, 20_000), (100_000, 200_000)),
    "TopK": ("capacity", 4, (1_000, 10_000, 100_000), (1_000_000, 4_000_000)),
    "Gram": ("columns", None, (64, 512, 1_024), (2_048, 4_096)),
}


def make_job(name: str, size: int):
    """The combiner and its rows (numpy; ``ROWS`` rows, Gram 20 per column up to that) for one case."""
    import numpy as np

    import sharded_scan as ss

    rng = np.random.default_rng(0)
    columns = CASES[name][1]
    if name == "Gram":
        return ss.Gram(), rng.standard_normal((min(ROWS, 20 * size), size), dtype=np.float32)
    if name == "TopK":
        return ss.TopK(k=10, capacity=size), rng.integers(0, 10 * size, (ROWS, columns)).astype(np.int32)
    x = rng.random((ROWS, columns), dtype=np.float32)
    if name == "Histogram":
        return ss.Histogram(bins=size, range=(0, 1)), x
    return ss.Quantiles(num_buckets=100, k=size), x


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(name: str, size: int, devices: int, fs_root: str | None = None) -> dict:
    """Runs one job in this (fresh) process; its estimate and measured peak (``fs_root``: where
    admission reads /proc and /sys)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import sharded_scan as ss
    from sharded_scan import admission
    from sharded_scan.admission import memory_need

    if fs_root:
        admission.FS_ROOT = fs_root
    from sharded_scan.program import build_program
    from sharded_scan.sources import as_source

    combiner, x = make_job(name, size)
    program = build_program(combiner, as_source(x), ss.RunOptions())
    need = memory_need(program)
    row = {"combiner": name, CASES[name][0]: size, "devices": devices, "rows": len(x),
           "estimate_mib": need.total / MIB, "parts_mib": {k: v / MIB for k, v in need.parts.items()}}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    before = status_bytes("VmRSS")
    ss.run(combiner, x)
    row["peak_mib"] = (status_bytes("VmHWM") - before) / MIB
    row["ratio"] = row["estimate_mib"] / row["peak_mib"]
    return row


def run_child(args: list[str], cgroup: str | None = None) -> subprocess.CompletedProcess:
    """``python bench/admission.py --child ARGS`` (inside ``cgroup``, a cgroup directory, when given)."""
    command = [sys.executable, __file__, "--child", *args]
    if cgroup:
        command = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def measure(devices: int, large: bool) -> list[dict]:
    """Every case at its sizes, one child each; prints a row as each ends."""
    rows = []
    print(f"{'combiner':<10} {'size':>12} {'estimate MiB':>13} {'peak MiB':>10} {'est/peak':>9}")
    for name, (param, _, sizes, large_sizes) in CASES.items():
        for size in large_sizes if large else sizes:
            done = run_child([name, str(size), str(devices)])
            if done.returncode:
                row = {"combiner": name, param: size, "devices": devices, "exit": done.returncode,
                       "stderr": done.stderr.strip().splitlines()[-1:]}
                print(f"{name:<10} {param}={size:<10} exit {done.returncode}: {row['stderr']}")
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{name:<10} {param + '=' + str(size):>12} {row['estimate_mib']:>13.1f} "
                      f"{row['peak_mib']:>10.1f} {row['ratio']:>9.2f}")
            rows.append(row)
    return rows


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A new memory cgroup (v2 or v1) limited to ``limit`` bytes below this process's own,
    or None where this machine does not let us make one."""
    from sharded_scan import admission

    made = None
    for group in admission.cgroup_dirs("/"):
        name = "memory.max" if group.version == 2 else "memory.limit_in_bytes"
        candidate = group.path / f"bench-admission-{os.getpid()}"
        try:
            candidate.mkdir()
            (candidate / name).write_text(str(limit))
        except OSError:
            with contextlib.suppress(OSError):
                candidate.rmdir()
            continue
        made = candidate
        break
    try:
        yield made
    finally:
        if made is not None:
            made.rmdir()


def container_case(devices: int, fake: bool) -> list[dict]:
    """Histograms in a 1 GiB container: one whose estimate exceeds it (one line, before compute?)
    and one that fits (it runs)."""
    limit = 1 << 30
    cases = []
    with contextlib.ExitStack() as stack:
        cgroup = None if fake else stack.enter_context(memory_cgroup(limit))
        where = []
        if cgroup is None:
            fake_root = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
            write_fake_cgroup_v2(fake_root, limit, usage=0)
            where = [str(fake_root)]
        kind = "real" if cgroup else "fake (admission.FS_ROOT)"
        print(f"\nin a {limit / MIB:.0f} MiB memory cgroup ({kind}):")
        for size, refused in ((2_000_000, True), (100_000, False)):
            done = run_child(["Histogram", str(size), str(devices), *where], str(cgroup) if cgroup else None)
            lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
            last = lines[-1] if lines else ""
            expected = "more than the" in last and done.returncode == 3 if refused else done.returncode == 0
            cases.append({"limit_mib": limit / MIB, "bins": size, "cgroup": kind, "exit": done.returncode,
                          "last_line": last, "expected": bool(expected)})
            print(f"  Histogram(bins={size}): exit {done.returncode} ({'as expected' if expected else 'NOT expected'})"
                  f"\n    {last[:400]}")
    return cases


def write_fake_cgroup_v2(root: pathlib.Path, limit: int, usage: int) -> None:
    """A /proc and /sys tree under ``root`` that says: cgroup v2, ``limit`` bytes, ``usage`` used."""
    (root / "proc/self").mkdir(parents=True)
    with open("/proc/meminfo") as f:
        (root / "proc/meminfo").write_text(f.read())
    (root / "proc/self/cgroup").write_text("0::/job\n")
    (root / "proc/self/mountinfo").write_text("30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    (root / "sys/fs/cgroup/job").mkdir(parents=True)
    (root / "sys/fs/cgroup/job/memory.max").write_text(f"{limit}\n")
    (root / "sys/fs/cgroup/job/memory.current").write_text(f"{usage}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="sizes up to a few GiB (several minutes)")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices of each job")
    parser.add_argument("--fake-cgroup", action="store_true", help="the container case on a fake cgroup tree")
    parser.add_argument("--child", nargs="+", metavar="COMBINER SIZE DEVICES [FS_ROOT]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, size, devices, *fs_root = args.child
        try:
            row = child(name, int(size), int(devices), *fs_root)
        except Exception as e:  # noqa: BLE001 - the parent reports the one line
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(3)
        print(json.dumps(row))
        return
    rows = measure(args.devices, args.large)
    container = container_case(args.devices, args.fake_cgroup)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"admission{'_large' if args.large else ''}.json"
    out.write_text(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(), "devices": args.devices,
                               "rows": rows, "container": container}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
