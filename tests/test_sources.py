"""Sources: every kind against the in-memory rows, ragged ranges, validation, resuming."""

import ast
import inspect
import os
import pathlib

import numpy as np
import pytest
import tensorstore as ts

import sharded_scan as ss
from sharded_scan import dtypes, sources
from sharded_scan.sources import (
    ArraySource,
    IteratorSource,
    NpyShardsSource,
    NpySource,
    SyntheticSource,
    TreeSource,
    ZarrSource,
    as_source,
)
from sharded_scan.sources import files as npy_files
from tests.helpers import f64, rel_err

N = 101  # prime: ragged against every step size below


def rows(n=N, d=3, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


def write_zarr(path, x, driver="zarr"):
    store = ts.open(
        {"driver": driver, "kvstore": {"driver": "file", "path": str(path)}},
        create=True, dtype=ts.dtype(x.dtype.name), shape=list(x.shape),
    ).result()
    store.write(x).result()


class Batches:
    """A re-iterable of ragged batches that exposes its state (resumable)."""

    def __init__(self, x, sizes):
        self.x, self.sizes, self.next_batch = x, sizes, 0

    def get_state(self):
        return {"batch": self.next_batch}

    def set_state(self, state):
        self.next_batch = state["batch"]

    def __iter__(self):
        starts = np.cumsum([0] + self.sizes)
        while self.next_batch < len(self.sizes):
            b = self.next_batch
            self.next_batch += 1
            yield self.x[starts[b] : starts[b + 1]]
        self.next_batch = 0


SIZES = [1, 7, 30, 2, 50, 11]  # sums to N


def make(kind, tmp_path, x):
    if kind == "array":
        return ArraySource(x)
    if kind == "npy":
        np.save(tmp_path / "x.npy", x)
        return NpySource(tmp_path / "x.npy")
    if kind == "shards":
        for i, part in enumerate(np.split(x, [5, 6, 60])):
            np.save(tmp_path / f"part-{i:02d}.npy", part)
        return NpyShardsSource(tmp_path)
    if kind == "zarr":
        write_zarr(tmp_path / "x.zarr", x)
        return ZarrSource(tmp_path / "x.zarr")
    if kind == "zarr3":
        write_zarr(tmp_path / "x3.zarr", x, "zarr3")
        return ZarrSource(tmp_path / "x3.zarr")
    if kind == "iterator":
        return IteratorSource(Batches(x, SIZES), N)
    raise AssertionError(kind)


KINDS = ["array", "npy", "shards", "zarr", "zarr3", "iterator"]


@pytest.mark.parametrize("kind", KINDS)
def test_reads_match_the_array(kind, tmp_path):
    x = rows()
    src = make(kind, tmp_path, x)
    assert src.num_rows == N and src.spec.shape == (3,) and src.spec.dtype == np.float32
    for start, stop in [(0, 1), (1, 6), (6, 6), (6, 59), (59, 60), (60, 101), (101, 101)]:
        np.testing.assert_array_equal(src.read(start, stop), x[start:stop])


@pytest.mark.parametrize("kind", KINDS + ["tree", "minimal"])
def test_the_last_steps_padded_read_is_the_rows_then_zeros_aligned(kind, tmp_path):
    x = rows()
    if kind == "tree":
        src = TreeSource({"npy": make("npy", tmp_path, x), "array": ArraySource(x)})
    else:
        src = Minimal(x) if kind == "minimal" else make(kind, tmp_path, x)
    src.read(0, 60)  # forward-only sources are then at row 60
    for start, stop, padded_rows in [(60, 101, 64), (101, 101, 8)]:
        got = src.read(start, stop, pad_to=padded_rows)
        if kind == "tree":
            np.testing.assert_array_equal(got["npy"], got["array"])
            got = got["npy"]
        want = np.zeros((padded_rows, 3), np.float32)
        want[: stop - start] = x[start:stop]
        np.testing.assert_array_equal(got, want)
        assert got.ctypes.data % sources.ALIGN == 0  # placed on CPU devices without a copy


class Minimal(sources.Source):
    """A user's source as sources were written before ``pad_to``: ``read(start, stop)`` alone."""

    def __init__(self, x):
        self.x = x

    @property
    def num_rows(self):
        return len(self.x)

    @property
    def spec(self):
        return sources.row_spec(self.x.shape, self.x.dtype)

    def read(self, start, stop):
        return self.x[start:stop]


def test_a_source_whose_read_takes_no_pad_to_is_padded_by_the_base():
    x = rows()
    src = Minimal(x)
    assert "pad_to" in inspect.signature(Minimal.read).parameters
    assert np.shares_memory(src.read(3, 9), x)  # no pad_to: its own rows, not a copy
    got = ss.run(ss.Sum(), src, mesh="data:2", microbatch=8, steps_per_call=2)  # ragged: the last step padded
    np.testing.assert_allclose(got.sum, f64(x).sum(0), rtol=1e-6)
    assert int(got.count) == N


def test_a_subclass_that_overrides_read_is_read_through_it_on_the_last_step_too(tmp_path):
    x = rows()
    np.save(tmp_path / "x.npy", x)

    class Doubled(NpySource):
        def read(self, start, stop):
            return 2 * super().read(start, stop)

    got = ss.run(ss.Sum(), Doubled(tmp_path / "x.npy"), mesh="data:2", microbatch=8, steps_per_call=2)  # ragged
    np.testing.assert_allclose(got.sum, 2 * f64(x).sum(0), rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mesh", ["data:1", "data:8"])
def test_run_over_each_source_matches_float64(kind, mesh, tmp_path):
    x = rows()
    got = ss.run(ss.Gram(), make(kind, tmp_path, x), mesh=mesh, microbatch=4, steps_per_call=2)
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5


def test_npy_reads_only_the_rows_asked_for(tmp_path, monkeypatch):
    x = rows(1000, 4)  # 16-byte rows
    np.save(tmp_path / "x.npy", x)
    src = NpySource(tmp_path / "x.npy", zero_copy=True)
    header = (tmp_path / "x.npy").stat().st_size - x.nbytes
    copied, mapped = [], []
    real_memmap, real_mmap = np.memmap, npy_files.mmap.mmap

    def spy_memmap(path, dtype, mode, offset, shape):
        copied.append((offset, shape))
        return real_memmap(path, dtype, mode, offset, shape)

    def spy_mmap(fileno, length, **kw):
        mapped.append((kw["offset"], length))
        return real_mmap(fileno, length, **kw)

    monkeypatch.setattr(npy_files.np, "memmap", spy_memmap)
    monkeypatch.setattr(npy_files.mmap, "mmap", spy_mmap)
    # Row 300 starts on a 64-byte boundary: a zero-copy view of a map of just those rows.
    np.testing.assert_array_equal(src.read(300, 307), x[300:307])
    begin, end = header + 300 * 16, header + 307 * 16
    [(offset, length)] = mapped
    assert offset <= begin < offset + npy_files.mmap.ALLOCATIONGRANULARITY and offset + length == end
    # Row 301 does not: those rows are copied out of a map of exactly them into an aligned array.
    np.testing.assert_array_equal(src.read(301, 307), x[301:307])
    assert copied == [(header + 301 * 16, (6, 4))]
    assert not isinstance(src.read(0, 2), real_memmap)


def test_npy_reads_copy_only_the_rows_asked_for_with_one_pread(tmp_path, monkeypatch):
    x = rows(1000, 4)
    np.save(tmp_path / "x.npy", x)
    src = NpySource(tmp_path / "x.npy")
    header = (tmp_path / "x.npy").stat().st_size - x.nbytes
    reads, real = [], npy_files.os.preadv

    def spy(fd, buffers, offset):
        reads.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(npy_files.os, "preadv", spy)
    for start, stop in [(300, 307), (301, 307)]:
        np.testing.assert_array_equal(src.read(start, stop), x[start:stop])
    assert reads == [(header + 300 * 16, 7 * 16), (header + 301 * 16, 6 * 16)]


@pytest.mark.parametrize("change", ["shrunk", "rewritten"])
def test_a_file_changed_while_the_job_reads_it_is_one_line_not_a_bus_error(tmp_path, change):
    x = rows(4000, 8)
    np.save(tmp_path / "x.npy", x)
    src = NpySource(tmp_path / "x.npy")
    if change == "shrunk":
        os.truncate(tmp_path / "x.npy", (tmp_path / "x.npy").stat().st_size // 2)
    else:
        np.save(tmp_path / "x.npy", x + 1)
        os.utime(tmp_path / "x.npy", ns=(0, 10**9))
    with pytest.raises(ss.UsageError) as err:
        ss.run(ss.Gram(), src, microbatch=64, steps_per_call=2)
    message = str(err.value)
    assert "\n" not in message and "changed while the job read it" in message and "x.npy" in message, message


def test_npy_shards_in_natural_order(tmp_path):
    x = rows(30, 2)
    for i in (10, 2, 1):  # part-1, part-2, part-10: lexicographic order would put part-10 second
        np.save(tmp_path / f"part-{i}.npy", x[{1: slice(0, 10), 2: slice(10, 20), 10: slice(20, 30)}[i]])
    src = NpyShardsSource(tmp_path)
    assert [os.path.basename(p) for p in src.paths] == ["part-1.npy", "part-2.npy", "part-10.npy"]
    np.testing.assert_array_equal(src.read(0, 30), x)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_fortran_order_files_read_like_np_load(tmp_path, zero_copy):
    """``np.save`` keeps Fortran order (a pandas frame's ``to_numpy()``, a transpose): numpy reads
    such files, so the source does too, as C-order rows."""
    for shape in [(1009, 5), (101, 2, 3), (50, 1)]:
        np.save(tmp_path / "f.npy", np.asfortranarray(np.arange(np.prod(shape), dtype=np.float32).reshape(shape)))
        x, src = np.load(tmp_path / "f.npy"), NpySource(tmp_path / "f.npy", zero_copy=zero_copy)
        for start, stop in [(0, shape[0]), (3, 17), (shape[0] - 1, shape[0]), (4, 4)]:
            got = src.read(start, stop)
            assert got.flags.c_contiguous, shape
            np.testing.assert_array_equal(got, x[start:stop])
    np.testing.assert_allclose(ss.run(ss.Gram(), NpySource(tmp_path / "f.npy"), mesh="data:2"), x.T @ x)


@pytest.mark.parametrize("kind", ["npy", "shards"])
def test_file_reads_are_aligned_for_zero_copy_placement(kind, tmp_path):
    src = make(kind, tmp_path, rows())
    for start, stop in [(0, 1), (3, 70), (1, 101)]:
        assert src.read(start, stop).ctypes.data % sources.ALIGN == 0


def test_synthetic_rows_do_not_depend_on_how_they_are_read():
    src = SyntheticSource(1000, 5, seed=3, chunk_rows=64)
    whole = src.read(0, 1000)
    assert whole.shape == (1000, 5) and whole.dtype == np.float32
    pieces = np.concatenate([src.read(a, b) for a, b in [(0, 1), (1, 63), (63, 64), (64, 500), (500, 1000)]])
    np.testing.assert_array_equal(pieces, whole)
    np.testing.assert_array_equal(SyntheticSource(1000, 5, seed=3, chunk_rows=64).read(130, 131), whole[130:131])
    assert not np.array_equal(SyntheticSource(1000, 5, seed=4, chunk_rows=64).read(0, 10), whole[:10])
    assert abs(whole.mean()) < 0.1 and abs(whole.std() - 1) < 0.1


def test_synthetic_targets_follow_a_hidden_linear_model():
    src = SyntheticSource(4000, 3, seed=1, targets=True, noise=0.01, chunk_rows=500)
    x, y = src.read(0, 4000)
    assert y.shape == (4000,)
    design = np.c_[f64(x), np.ones(4000)]
    fit = np.linalg.lstsq(design, f64(y), rcond=None)[0]
    np.testing.assert_allclose(fit[:3], src.coef, atol=1e-2)
    np.testing.assert_allclose(fit[3], src.intercept, atol=1e-2)
    xs, ys = src.read(1234, 1800)
    np.testing.assert_array_equal(xs, x[1234:1800])
    np.testing.assert_array_equal(ys, y[1234:1800])


def test_pytree_of_sources_reads_together(tmp_path):
    x, y = rows(), rows(d=1, seed=1)[:, 0]
    np.save(tmp_path / "x.npy", x)
    src = as_source((NpySource(tmp_path / "x.npy"), y))
    assert isinstance(src, TreeSource)
    got_x, got_y = src.read(10, 20)
    np.testing.assert_array_equal(got_x, x[10:20])
    np.testing.assert_array_equal(got_y, y[10:20])
    result = ss.run(ss.Sum(), src, microbatch=4)
    assert rel_err(result.sum[0], f64(x).sum(0)) < 1e-5 and rel_err(result.sum[1], f64(y).sum()) < 1e-5
    with pytest.raises(ss.UsageError, match="different row counts"):
        as_source((NpySource(tmp_path / "x.npy"), y[:-1]))


def test_bad_inputs_are_one_line_usage_errors(tmp_path):
    np.save(tmp_path / "scalar.npy", np.float32(1))
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    (tmp_path / "junk.npy").write_bytes(b"not a numpy file")
    (tmp_path / "shards").mkdir()
    np.save(tmp_path / "shards" / "a.npy", rows(d=3))
    np.save(tmp_path / "shards" / "b.npy", rows(d=4))
    (tmp_path / "dtypes").mkdir()
    np.save(tmp_path / "dtypes" / "a.npy", rows())
    np.save(tmp_path / "dtypes" / "b.npy", rows(dtype=np.float64))
    cases = [
        (lambda: NpySource(tmp_path / "missing.npy"), "no such"),
        (lambda: NpySource(tmp_path / "junk.npy"), "cannot read"),
        (lambda: NpySource(tmp_path / "scalar.npy"), "scalar"),
        (lambda: NpySource(tmp_path / "strings.npy"), "numeric"),
        (lambda: NpyShardsSource(tmp_path / "nothing-*.npy"), "no .npy shards"),
        (lambda: NpyShardsSource(tmp_path / "shards"), "same features"),
        (lambda: NpyShardsSource(tmp_path / "dtypes"), "same features and dtype"),
        (lambda: ZarrSource(tmp_path / "missing.zarr"), "no such zarr"),
        (lambda: ZarrSource(tmp_path / "shards"), "cannot open"),
        (lambda: SyntheticSource(10, 0), "features"),
        (lambda: SyntheticSource(10, 3, dtype="int32"), "float dtype"),
        (lambda: SyntheticSource(10, 3, kind="cauchy"), "kind"),
        (lambda: IteratorSource([np.array(["x"])], 1), "numeric"),
        (lambda: IteratorSource(iter([]), 1), "no batch"),
    ]
    for build, match in cases:
        with pytest.raises(ss.UsageError, match=match) as info:
            build()
        assert "\n" not in str(info.value)


def test_truncated_npy_is_reported(tmp_path):
    np.save(tmp_path / "x.npy", rows(100))
    data = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(data[:-50])
    with pytest.raises(ss.UsageError, match="truncated"):
        NpySource(tmp_path / "x.npy")


def test_iterator_with_wrong_rows_fails_in_the_caller():
    short = IteratorSource([rows(10)], 20)
    with pytest.raises(ss.UsageError, match="ended at row 10"):
        ss.run(ss.Sum(), short, microbatch=4)
    mixed = IteratorSource([rows(10), rows(10, d=4)], 20)
    with pytest.raises(ss.UsageError, match="expected"):
        ss.run(ss.Sum(), mixed, microbatch=4)


def test_non_resumable_iterator_says_so():
    src = IteratorSource(iter([rows(10), rows(10)]), 20)
    assert not src.resumable and src.sequential
    with pytest.raises(ss.UsageError, match="not resumable") as info:
        src.seek(8)
    assert "\n" not in str(info.value)
    with pytest.raises(ss.UsageError, match="not resumable"):
        src.state_at(8)
    src.seek(0)  # from the start is fine while nothing was read
    np.testing.assert_array_equal(src.read(0, 20), np.concatenate([rows(10), rows(10)]))
    with pytest.raises(ss.UsageError, match="one-shot"):
        src.seek(0)


class OneShotWithState(Batches):
    """The batches as an iterator (``iter`` gives itself) with their state, as grain's dataset iterators."""

    def __iter__(self):
        return self

    def __next__(self):
        if self.next_batch == len(self.sizes):
            raise StopIteration
        starts = np.cumsum([0] + self.sizes)
        self.next_batch += 1
        return self.x[starts[self.next_batch - 1] : starts[self.next_batch]]


def test_only_an_iterator_without_state_is_read_once_and_a_reduction_of_several_passes_refuses_it():
    x = rows(3001, d=2)
    one_shot = IteratorSource(iter(np.split(x, [1000, 2000])), len(x))
    assert not one_shot.rereadable and not TreeSource((one_shot, ArraySource(x[:, 0]))).rereadable
    assert IteratorSource(Batches(rows(), SIZES), N).rereadable and TreeSource((ArraySource(x),)).rereadable
    exact = ss.Quantiles(qs=[0.1, 0.5, 0.9], k=64, exact=True, method="lower")
    with pytest.raises(ss.UsageError, match="one-shot") as info:
        ss.run(exact, one_shot, microbatch=64, steps_per_call=2)
    assert "\n" not in str(info.value)
    with_state = IteratorSource(OneShotWithState(x, [17] * 176 + [9]), len(x))
    assert with_state.rereadable  # rewound through its state, pass after pass
    got = ss.run(exact, with_state, microbatch=64, steps_per_call=2)
    assert got.passes > 1
    np.testing.assert_array_equal(got.quantiles, np.quantile(f64(x), [0.1, 0.5, 0.9], axis=0, method="lower").T)


def test_sources_import_their_dtype_checks_from_below_never_from_combiners():
    for path in pathlib.Path(sources.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.startswith("sharded_scan.combiners") for n in names), (path.name, names)
    assert ss.hash_strings is ss.combiners.hash_strings is dtypes.hash_strings  # one home, exported


def test_resumable_iterator_resumes_at_any_row():
    x = rows()
    src = IteratorSource(Batches(x, SIZES), N)
    assert src.resumable
    for cursor in [0, 1, 8, 37, 38, 100, 101]:
        src.seek(0)
        src.read(0, min(cursor + 5, N))  # reads past the cursor, as a reader thread does
        state = src.state_at(cursor)
        fresh = IteratorSource(Batches(x, SIZES), N)
        fresh.seek(cursor, state)
        np.testing.assert_array_equal(fresh.read(cursor, N), x[cursor:])


def test_iterator_reads_forward_only_and_may_skip():
    x = rows()
    src = IteratorSource(Batches(x, SIZES), N)
    np.testing.assert_array_equal(src.read(3, 9), x[3:9])
    np.testing.assert_array_equal(src.read(40, 41), x[40:41])
    with pytest.raises(ValueError, match="forward only"):
        src.read(10, 12)


@pytest.mark.parametrize("driver, chunk", [("zarr", "1.0"), ("zarr3", "c/1/0")])
def test_a_missing_zarr_chunk_is_an_error_unless_the_fill_value_is_asked_for(tmp_path, driver, chunk):
    x = rows(40, 2) + 5
    path = tmp_path / "x.zarr"
    store = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": str(path)}}, create=True,
                    dtype=ts.float32, shape=[40, 2], chunk_layout=ts.ChunkLayout(chunk_shape=[10, 2])).result()
    store.write(x).result()
    os.remove(path / chunk)  # rows 10..19
    with pytest.raises(ss.UsageError) as err:
        ss.run(ss.Sum(), ZarrSource(path), microbatch=4, steps_per_call=2)
    message = str(err.value)
    assert "\n" not in message and "lacks a chunk" in message and "fill_missing=True" in message, message
    got = ss.run(ss.Sum(), ZarrSource(path, fill_missing=True), microbatch=4, steps_per_call=2)
    np.testing.assert_allclose(got.sum, x[:10].sum(0) + x[20:].sum(0), rtol=1e-6)  # the fill value is 0
