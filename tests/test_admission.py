"""Memory admission that knows its container: cgroup v1/v2 limits read from fake /proc and
/sys trees, an accelerator's free memory, and a job over the limit refused in one line."""

import ast
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import admission
from sharded_scan.options import RunOptions
from sharded_scan.program import build_program
from sharded_scan.sources import as_source

GIB = 1 << 30
HOST_AVAILABLE = 64 * GIB


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc(root, cgroup_lines, mount_lines, available=HOST_AVAILABLE):
    write(root / "proc/meminfo", f"MemTotal: {2 * available // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    write(root / "proc/self/cgroup", "".join(line + "\n" for line in cgroup_lines))
    write(root / "proc/self/mountinfo", "".join(line + "\n" for line in mount_lines))


def cgroup_v2(root, limit, usage, inactive_file=0, parent_limit="max"):
    """A systemd-style v2 host: this process in /user.slice/job, its parent with ``parent_limit``."""
    proc(root, ["0::/user.slice/job"], ["30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw"])
    group = root / "sys/fs/cgroup/user.slice/job"
    write(group / "memory.max", f"{limit}\n")
    write(group / "memory.current", f"{usage}\n")
    write(group / "memory.stat", f"anon {usage}\ninactive_file {inactive_file}\nactive_file 0\n")
    write(group.parent / "memory.max", f"{parent_limit}\n")
    write(group.parent / "memory.current", f"{usage}\n")


def cgroup_v1(root, limit, usage, container=False):
    """A v1 memory hierarchy; ``container``: mounted at the job's own group (docker without
    cgroup namespaces: /proc/self/cgroup names the host's path, the mount's root is that path)."""
    mount_root = "/docker/abc" if container else "/"
    proc(root, ["12:pids:/docker/abc", "4:memory:/docker/abc", "1:name=systemd:/docker/abc", "0::/"],
         [f"35 31 0:32 {mount_root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory",
          "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"])
    group = root / "sys/fs/cgroup/memory" / ("" if container else "docker/abc")
    write(group / "memory.limit_in_bytes", f"{limit}\n")
    write(group / "memory.usage_in_bytes", f"{usage}\n")
    write(group / "memory.stat", "cache 0\ntotal_inactive_file 0\n")
    if not container:  # the root group: no limit, written as v1 writes it
        write(root / "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
        write(root / "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{8 * GIB}\n")


def test_cgroup_v2_limit_less_usage(tmp_path):
    cgroup_v2(tmp_path, limit=3 * GIB, usage=GIB)
    assert admission.cgroup_room(tmp_path) == (2 * GIB, 3 * GIB)
    room, what = admission.host_available(tmp_path)
    assert room == 2 * GIB and "cgroup" in what and "limit 3.0 GiB" in what


def test_cgroup_v2_page_cache_it_can_drop_is_room(tmp_path):
    cgroup_v2(tmp_path, limit=3 * GIB, usage=2 * GIB, inactive_file=GIB // 2)
    assert admission.cgroup_room(tmp_path)[0] == GIB + GIB // 2


def test_cgroup_v2_a_tighter_parent_counts(tmp_path):
    cgroup_v2(tmp_path, limit=8 * GIB, usage=GIB, parent_limit=2 * GIB)
    assert admission.cgroup_room(tmp_path) == (GIB, 2 * GIB)


def test_cgroup_v2_max_is_no_limit(tmp_path):
    cgroup_v2(tmp_path, limit="max", usage=GIB)
    assert admission.cgroup_room(tmp_path) is None
    assert admission.host_available(tmp_path) == (HOST_AVAILABLE, "available host memory")


@pytest.mark.parametrize("container", [False, True])
def test_cgroup_v1_limit_less_usage(tmp_path, container):
    cgroup_v1(tmp_path, limit=3 * GIB, usage=GIB // 2, container=container)
    assert admission.cgroup_room(tmp_path) == (3 * GIB - GIB // 2, 3 * GIB)


def test_cgroup_v1_huge_limit_is_no_limit(tmp_path):
    cgroup_v1(tmp_path, limit=9223372036854771712, usage=GIB)
    assert admission.cgroup_room(tmp_path) is None


def test_the_host_wins_when_it_has_less_than_the_cgroup(tmp_path):
    cgroup_v2(tmp_path, limit=3 * GIB, usage=0)
    write(tmp_path / "proc/meminfo", f"MemAvailable: {GIB // 1024} kB\n")
    assert admission.host_available(tmp_path) == (GIB, "available host memory")


def test_no_cgroup_files_no_limit(tmp_path):
    write(tmp_path / "proc/meminfo", f"MemAvailable: {GIB // 1024} kB\n")
    assert admission.cgroup_dirs(tmp_path) == [] and admission.cgroup_room(tmp_path) is None
    assert admission.host_available(tmp_path) == (GIB, "available host memory")


class FakeAccelerator:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_an_accelerator_offers_its_limit_less_what_is_in_use():
    room, what = admission.device_available(FakeAccelerator({"bytes_limit": 16 * GIB, "bytes_in_use": 6 * GIB}))
    assert room == 10 * GIB and what.startswith("free GPU memory")
    assert admission.device_available(FakeAccelerator(None)) == (None, "")


def test_live_peak_counts_the_values_alive_at_once():
    n = 1000

    def f(x):
        doubled = x * 2  # n floats, alive until the add has run
        return (doubled + 1).sum()  # then n more; the sum leaves one

    jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((n,), jnp.float32)).jaxpr
    assert admission.live_peak(jaxpr) == 2 * n * 4


X = np.random.default_rng(0).random((5000, 16), dtype=np.float32)
JOB = ss.Histogram(bins=200_000, range=(0, 1))
OPTIONS = RunOptions(mesh="data:2")
EDGES = 16 * (JOB.bins + 1) * 4  # the operands: float32 inner edges (16, bins - 1), lo and hi (16,) each


def test_a_job_over_its_cgroups_room_is_one_line_before_compute(tmp_path, monkeypatch):
    need = admission.memory_need(build_program(JOB, as_source(X), OPTIONS))
    assert need.parts["operands"] == EDGES  # a device's: whole on each of the 2 (and the host's copy in "host")
    need = need.total
    cgroup_v2(tmp_path, limit=need + GIB // 4, usage=GIB // 4 + 1)  # one byte short
    monkeypatch.setattr(admission, "FS_ROOT", str(tmp_path))
    with pytest.raises(ss.UsageError) as err:
        ss.run(JOB, X, OPTIONS, checkpoint=tmp_path / "ck")
    message = str(err.value)
    assert "\n" not in message and "more than the" in message and "cgroup (limit" in message
    assert "operands 0.01 GiB" in message and "grow the mesh's 'model' axis" in message
    assert "(the combiner's operands, 0.01 GiB a device, shrink as 'model' grows)" in message  # with the counts
    assert not (tmp_path / "ck").exists()  # refused before anything ran
    cgroup_v2(tmp_path, limit=need + GIB // 4, usage=GIB // 4)  # exactly enough
    build_program(JOB, as_source(X), OPTIONS)


def test_operands_split_over_model_with_the_counts_and_whole_ones_alone_are_named():
    whole, split = (admission.memory_estimate(build_program(JOB, as_source(X), RunOptions(mesh=mesh)))
                    for mesh in ("data:2", "data:2,model:2"))
    # The edges split with the counts' 16 columns: each device holds 8 columns' (test_wide_model: which).
    assert split["accumulator"] <= 0.51 * whole["accumulator"] and 2 * split["operands"] == whole["operands"] == EDGES
    program = build_program(JOB, as_source(X), OPTIONS)
    for alone, start in ((True, "alone (8.00 GiB a device) do not fit: "), (False, "are the most of it: ")):
        advice = admission.axis_to_grow(program, {**whole, "operands": 8 * GIB}, operands_alone=alone)
        assert advice.startswith(f"the combiner's operands {start}grow the mesh's 'model' axis"), advice
    # The weighted form's sums and edges split the same way (test_wide_model: bitwise the whole run's).
    weighted = build_program(ss.Weighted(JOB), as_source((X[:, 0], X)), RunOptions(mesh="data:2,model:2"))
    assert 2 * admission.memory_estimate(weighted)["operands"] == EDGES
    # A gradient's parameters stay whole on every device: no axis shrinks them.
    gradient = build_program(ss.Gradient(lambda p, x: x @ p, np.ones(16, np.float32)), as_source(X), OPTIONS)
    advice = admission.axis_to_grow(gradient, {**whole, "operands": 8 * GIB}, operands_alone=True)
    assert advice.startswith("the combiner's operands alone (8.00 GiB, whole") and "'model'" not in advice
    advice = admission.axis_to_grow(gradient, {**whole, "operands": 8 * GIB})  # the most of the peak
    assert advice.startswith("the combiner's operands are the most of it and whole") and "'model'" not in advice


# The build (program.py) calls admission on the Program it makes; admission reads that Program, the
# merge's route states the merge's bytes. Each module of the chain imports only those before it.
ONE_WAY = ("sharding", "merging", "compiled", "admission", "program")


def imported_modules(module: str) -> set[str]:
    """Every module ``sharded_scan.<module>`` imports anywhere: at its top, in a function, for type checking."""
    tree = ast.parse(pathlib.Path(importlib.import_module(f"sharded_scan.{module}").__file__).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_admission_and_the_build_import_one_way():
    for i, module in enumerate(ONE_WAY):
        above = {f"sharded_scan.{name}" for name in ONE_WAY[i + 1:]}
        assert not imported_modules(module) & above, module


def test_the_estimate_reads_the_add_from_the_steps_trace_which_the_run_reuses(monkeypatch):
    """One micro-batch's temporaries come from the step's own trace, which the run's first step reuses:
    the add is traced once a scan of the step (one: a small step's shards fold masked rows only), never once
    more for the estimate."""
    calls = []
    add = ss.Moments.add
    monkeypatch.setattr(ss.Moments, "add", lambda self, *args: calls.append(1) or add(self, *args))
    x = np.random.default_rng(1).random((300, 3), dtype=np.float32)  # 2 steps of 256 rows: the last ragged
    options = RunOptions(mesh="data:2", microbatch=64, steps_per_call=2)
    program = build_program(ss.Moments(), as_source(x), options)
    assert admission.memory_estimate(program)["temporary"] >= 64 * 3 * 4  # one micro-batch's centered values
    assert admission._temporaries(program)[1] > 0  # two shards: a merge of two states traced
    got = ss.run(ss.Moments(), x, options)
    assert len(calls) == 1  # 2 where the estimate traced the add on its own
    np.testing.assert_allclose(got.mean, x.mean(0), rtol=1e-5)
    alone = build_program(ss.Moments(), as_source(x), RunOptions(mesh="data:1", microbatch=64, steps_per_call=2))
    assert admission._temporaries(alone)[1] == 0  # one shard: no two states merged, no merge traced
    merges = []
    merge = ss.Moments.merge
    monkeypatch.setattr(ss.Moments, "merge", lambda self, *args: merges.append(1) or merge(self, *args))
    other = build_program(ss.Moments(), as_source(x), RunOptions(mesh="data:2", microbatch=32, steps_per_call=2))
    assert admission._temporaries(other)[1] > 0 and not merges  # another micro-batch: the merge is not traced again
