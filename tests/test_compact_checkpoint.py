"""Compact checkpoints (one merged state a save) and the sharded elastic restore of per-shard ones."""

import logging
import math
import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharded_scan as ss
from sharded_scan import relayout
from sharded_scan.checkpoint_damage import DAMAGED
from sharded_scan.checkpoint_store import META, PARTIALS
from sharded_scan.layout import data_sharding
from sharded_scan.program import program_for_spec
from tests.helpers import CrashError, crash_at, f64, rel_err

KW = {"microbatch": 8, "steps_per_call": 2}  # 8 devices: 128 rows per step
X = np.random.default_rng(3).normal(size=(1009, 5)).astype(np.float32)
HIST = ss.Histogram(bins=7, range=(-2.0, 2.0))


def crashed_run(directory, combiner, compact, mesh="data:8"):
    """Checkpoints at cursors 256, 384, 512 of a run that died in step 5."""
    options = ss.CheckpointOptions(str(directory), every_steps=1, keep=3, compact=compact)
    with pytest.raises(CrashError):
        ss.run(combiner, X, mesh=mesh, checkpoint=options, progress=crash_at(5), **KW)
    assert sorted(int(n) for n in os.listdir(directory)) == [256, 384, 512]
    return directory


@pytest.fixture(scope="module")
def compact_gram(tmp_path_factory):
    return crashed_run(tmp_path_factory.mktemp("compact") / "ck", ss.Gram(), compact=True)


def copied(original, tmp_path):
    shutil.copytree(original, tmp_path / "ck")
    return tmp_path / "ck"


def stored(step):
    """The meta and the stored partials' (shape, dtype) of a step directory."""
    meta = ocp.JsonCheckpointHandler().restore(step / META)
    tree = ocp.PyTreeCheckpointHandler().metadata(step / PARTIALS)
    tree = dict(getattr(tree, "tree", tree))
    return meta, [(tuple(tree[k].shape), np.dtype(tree[k].dtype)) for k in sorted(tree, key=int)]


def test_a_compact_save_is_one_state_split_over_every_device(compact_gram):
    program = program_for_spec(ss.Gram(), jax.ShapeDtypeStruct((5,), np.float32), len(X),
                               ss.RunOptions(mesh="data:8", **KW))
    state = [s.shape[1:] for s in jax.tree.leaves(program.like)]
    one_state = sum(math.prod(s) * 4 for s in state)
    meta, leaves = stored(compact_gram / "512")
    assert (meta["shards"], meta["compact"]) == (1, 8)
    # Flat leaves padded to a multiple of the 8 devices: one state and at most 7 values a leaf more.
    assert [shape for shape, _ in leaves] == [(-(-math.prod(s) // 8) * 8,) for s in state]
    assert one_state <= sum(shape[0] * dtype.itemsize for shape, dtype in leaves) <= one_state + 7 * 4 * len(state)
    # Each device holds (and writes) 1/8 of each leaf.
    flat, shape = relayout.compact(program, program.init())
    assert shape == {"shards": 1, "axes": {}, "compact": 8}
    for leaf in flat:
        assert len({s.device for s in leaf.addressable_shards}) == 8
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {leaf.shape[0] // 8}


def test_a_compact_checkpoint_resumes_on_any_device_count_every_row_once(compact_gram, tmp_path):
    directory = copied(compact_gram, tmp_path)
    options = ss.CheckpointOptions(str(directory), every_steps=1, compact=False)  # either option resumes either kind
    got, report = ss.run_with_report(ss.Gram(), X, mesh="data:3", checkpoint=options, **KW)
    assert report.resumed_from_cursor == 512 and report.devices == 3
    assert rel_err(got, f64(X).T @ f64(X)) < 1e-5  # merged in another order: to float rounding, not bitwise
    counts = np.stack([np.histogram(X[:, j], 7, (-2.0, 2.0))[0] for j in range(5)])
    directory = crashed_run(tmp_path / "hist", HIST, compact=True)
    got, report = ss.run_with_report(HIST, X, mesh="data:8", checkpoint=ss.CheckpointOptions(str(directory)), **KW)
    assert report.resumed_from_cursor == 512
    np.testing.assert_array_equal(got.counts, counts)  # integer counts: exact


W = np.random.default_rng(4).uniform(0, 2, len(X)).astype(np.float32)  # a weighted job's rows are (W, X)


def weighted(combiner):
    return isinstance(combiner, ss.Weighted)


def spec(combiner):
    row = jax.ShapeDtypeStruct((5,), np.float32)
    return (jax.ShapeDtypeStruct((), np.float32), row) if weighted(combiner) else row


def stepped(program, combiner=None):
    """``program``'s partials after one step of X's rows, weighted by W for a weighted ``combiner`` (not the
    identity)."""
    rows = program.layout.rows_per_step
    batch = (W[:rows], X[:rows]) if weighted(combiner) else X[:rows]
    return program.step(program.init(), jax.device_put(batch, data_sharding(program.mesh)), rows)


@pytest.mark.parametrize("combiner,mesh", [(ss.Gram(), "data:8"), (HIST, "data:8"), (ss.Gram(), "data:4,model:2"),
                                           (HIST, "model:2,data:4"),  # split counts, whole columns (a
                                           (ss.Sum(), "data:4,model:2"),  # whole leaf on either order)
                                           (ss.Weighted(HIST), "data:4,model:2")])  # split float sums
def test_a_compact_save_of_a_sum_reduce_scatters_the_state_the_psum_merged(combiner, mesh):
    program = program_for_spec(combiner, spec(combiner), len(X), ss.RunOptions(mesh=mesh, **KW))
    assert relayout.scatters(program)
    partials = stepped(program, combiner)
    flat, _ = relayout.compact(program, partials)
    # The long way: the run's merge (one psum, every device the whole state or its model block), each
    # leaf flattened, padded and split (a split one gathered whole first).
    longway = relayout.merged_and_split(program, partials)
    split = program.combiner.partition(program.mesh) is not None  # Gram: 5 columns padded to 6, 30 values over 8
    assert split or not weighted(combiner)  # a weighted histogram's float sums split with its columns
    for leaf, want in zip(flat, longway, strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(program.mesh, P(program.mesh.axis_names)), 1)
        assert leaf.shape == want.shape
        got, want = np.asarray(leaf), np.asarray(want)
        if np.issubdtype(want.dtype, np.integer):
            np.testing.assert_array_equal(got, want)
        else:  # a sum in another collective: the same values to rounding (no code of ours pins its order)
            np.testing.assert_allclose(got, want, rtol=1e-6)
    # One program, one reduce-scatter over data a leaf, of only what its devices keep: a leaf whole on each
    # device the D pieces of the devices at its place on model ([D, piece], 1/M of the padded flat leaf); a
    # split one its model block, flat, padded to D runs.
    hlo = relayout.compile_scatter_sum(program.combiner, program.mesh).lower(program.like).as_text()
    n, d = program.mesh.size, program.layout.data_size
    sizes = [(math.prod(s.shape[1:]), relayout.split_axis(s.sharding.spec)) for s in jax.tree.leaves(program.like)]
    assert re.findall(r"reduce_scatter.*?\}\) : \(tensor<([\dx]+)x\w+>\)", hlo, re.S) == [
        f"{d}x{-(-size // n)}" if axis is None else str(-(-size // (n // d) // d) * d) for size, axis in sizes]
    assert "all_reduce" not in hlo and "all_gather" not in hlo and "all_to_all" not in hlo
    # A split leaf's pieces are then permuted (none move for a histogram on model:2,data:4: block m's runs
    # are pieces m*4..m*4+3).
    assert ("collective_permute" in hlo) == (split and mesh == "data:4,model:2")
    # logical_shards fixes the merge's order (its tree): no psum to scatter. The route is the options', whatever the
    # combiner: checked for the whole Gram and the split one (each program traced for its memory estimate).
    if isinstance(combiner, ss.Gram):
        assert not relayout.scatters(program_for_spec(combiner, spec(combiner), len(X),
                                                      ss.RunOptions(mesh=mesh, logical_shards=8, **KW)))


def flipped_stored_byte(step):
    """One byte of the b-tree file every read of the step goes through: a compact state is small
    enough that OCDBT keeps its values inline there (the writers' own data files, under
    ``ocdbt.process_*``, are not read once merged, so flipping their largest was a coin toss)."""
    path = max(sorted((step / PARTIALS / "d").iterdir()), key=lambda f: f.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_compact_checkpoint_is_set_aside_and_the_one_before_used(compact_gram, tmp_path, caplog):
    directory = copied(compact_gram, tmp_path)
    flipped_stored_byte(directory / "512")
    with caplog.at_level(logging.WARNING, logger="sharded_scan.checkpoint"):
        got, report = ss.run_with_report(ss.Gram(), X, mesh="data:8", checkpoint=ss.CheckpointOptions(str(directory)),
                                         **KW)
    assert report.resumed_from_cursor == 384
    assert rel_err(got, f64(X).T @ f64(X)) < 1e-5
    assert "skipping the damaged checkpoint 512" in caplog.text
    assert [p.split("-")[0] for p in os.listdir(directory / DAMAGED)] == ["512"]
    with pytest.raises(ss.UsageError, match="different job"):  # the fingerprint still names the job
        ss.run(ss.Gram(), X[:1000], mesh="data:8", checkpoint=ss.CheckpointOptions(str(directory)), **KW)


def shards_a_device(partials):
    return jax.tree.leaves(partials)[0].addressable_shards[0].data.shape[0]


def test_the_sharded_elastic_restore_is_bitwise_the_one_device_fold(tmp_path, monkeypatch):
    original = crashed_run(tmp_path / "per-shard", ss.Gram(), compact=False)
    folds, tree_fold = [], relayout.process_tree_fold
    monkeypatch.setattr(relayout, "process_tree_fold", lambda *a: folds.append(shards_a_device(a[2])) or tree_fold(*a))
    got = {}
    for sharded in (True, False):  # 8 saved shards read 2 a device on 4 devices, or whole on the host
        if not sharded:
            monkeypatch.setattr(relayout, "folds_on_devices", lambda *a: False)
        directory = copied(original, tmp_path / str(sharded))
        got[sharded], report = ss.run_with_report(ss.Gram(), X, mesh="data:4",
                                                   checkpoint=ss.CheckpointOptions(str(directory)), **KW)
        assert report.resumed_from_cursor == 512
    assert folds == [2]  # the sharded read was folded by the process tree, 2 shards a device
    np.testing.assert_array_equal(got[True], got[False])
    assert rel_err(got[True], f64(X).T @ f64(X)) < 1e-5


def finished_and_resumed(directory):
    """In each process: a compact job and a per-shard ``logical_shards=16`` one run to their end, then
    each resumed from its final checkpoint, the per-shard one without ``logical_shards`` (16 saved
    shards onto 8: read over the devices, folded over the processes). Run by 2 processes of 4 devices."""
    folds, tree_fold = [], relayout.process_tree_fold
    relayout.process_tree_fold = lambda *a: folds.append(shards_a_device(a[2])) or tree_fold(*a)
    out = {}
    for name, compact, logical in (("compact", True, None), ("per-shard", False, 16)):
        options = ss.CheckpointOptions(f"{directory}/{name}", every_steps=100, compact=compact)
        out[name] = ss.run(ss.Gram(), X, mesh="data:-1", checkpoint=options, logical_shards=logical, **KW)
        out[f"{name} resumed"], report = ss.run_with_report(ss.Gram(), X, mesh="data:-1", checkpoint=options, **KW)
        assert (report.resumed_from_cursor, report.steps) == (len(X), 0)
    return out, folds


def test_two_processes_save_compact_and_fold_a_sharded_restore(tmp_path):
    from tests import multiprocess

    got = multiprocess.run_processes("tests.test_compact_checkpoint:finished_and_resumed", 2, 4, timeout=240,
                                     kwargs={"directory": str(tmp_path)})
    (first, folds), (second, _) = got
    assert folds == [2]  # 16 shards read 2 a device and folded over the devices, then the 2 processes
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value, err_msg=name)  # every process the same
    # A finished job resumed merges its state with identities: the state saved. The per-shard
    # one's fold of 16 partials is bitwise the logical_shards=16 merge in one process of 8 devices.
    np.testing.assert_array_equal(first["per-shard resumed"], first["per-shard"])
    np.testing.assert_array_equal(first["per-shard"], ss.run(ss.Gram(), X, mesh="data:8", logical_shards=16, **KW))
    # The compact save reduce-scatters the partials where the run's result is their psum: over processes
    # (gloo) the two add in other orders, so the state saved is the result to rounding, not bitwise.
    assert rel_err(first["compact resumed"], first["compact"]) < 1e-6
    assert rel_err(first["compact"], f64(X).T @ f64(X)) < 1e-5
