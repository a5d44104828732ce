"""The engine: sharding, the ragged tail, micro-batch independence, collectives, bad input."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import merging, program
from tests.helpers import collectives, f64, rel_err

MESHES = ["data:1", "data:2", "data:8", "data:4,model:2"]


def rows(n, d=5, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("n", [1, 3, 7, 97, 1000])
def test_gram_and_sum_match_float64(mesh, n):
    x = rows(n)
    assert rel_err(ss.run(ss.Gram(), x, mesh=mesh, microbatch=8, steps_per_call=2), f64(x).T @ f64(x)) < 1e-5
    result = ss.run(ss.Sum(), x, mesh=mesh, microbatch=8, steps_per_call=2)
    assert result.count == n
    assert rel_err(result.sum, f64(x).sum(0)) < 1e-5


# (8, 2) on data:8 is test_gram_and_sum_match_float64's program: one compile fewer, the same span of layouts
@pytest.mark.parametrize("microbatch, steps_per_call", [(1, 1), (3, 5), (8, 2), (64, 8), (4096, 2)])
def test_result_independent_of_microbatch_and_steps(microbatch, steps_per_call):
    x = rows(1009)
    got = ss.run(ss.Gram(), x, mesh="data:8", microbatch=microbatch, steps_per_call=steps_per_call)
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5


def test_bfloat16_rows_accumulate_in_float32():
    x = rows(515, d=6).astype(ml_dtypes.bfloat16)
    got = ss.run(ss.Gram(), x, microbatch=16)
    assert got.dtype == np.float32
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5


def test_integer_rows_are_counted_exactly():
    x = np.arange(3 * 333, dtype=np.int32).reshape(333, 3)
    result = ss.run(ss.Sum(), x, microbatch=5)
    np.testing.assert_array_equal(result.sum, x.sum(0))


def test_pytree_data_sums_every_leaf():
    x, y = rows(101, d=4), rows(101, d=1, seed=1)[:, 0]
    result = ss.run(ss.Sum(), {"x": x, "y": y}, microbatch=4)
    assert rel_err(result.sum["x"], f64(x).sum(0)) < 1e-5
    assert rel_err(result.sum["y"], f64(y).sum()) < 1e-5
    assert result.count == 101


class MaxAbs(ss.Combiner):
    """A user combiner written against the protocol: column-wise max |x| (not additive)."""

    def init(self, spec):
        return jnp.zeros(spec.shape, jnp.float32)

    def add(self, acc, batch, mask):
        return jnp.maximum(acc, jnp.max(jnp.where(mask[:, None], jnp.abs(batch), 0.0), axis=0))

    def merge(self, a, b):
        return jnp.maximum(a, b)

    def finalize(self, acc):
        return acc


def test_a_lone_shard_is_merged_without_a_program():
    # Issue 45 (a small job that answers at once): on one device the merge compiled a program that only took the
    # lone shard out of the stacked partials; now a one-device job of a pairwise merge compiles its step alone (its
    # identity partials are made on the host: compiled.host_identity, no init program), also where the accumulator
    # holds an inf that its identity does not (engine.nonfinite_values compiled the identity op by op).
    compiled = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":  # also a program loaded from the persistent cache
            compiled.append(kwargs.get("fun_name"))

    combiner = MaxAbs()  # a new one: none of its programs is memoized yet
    x = rows(77, d=3)
    x[5, 1] = -np.inf
    built = program.build_program(combiner, ss.sources.as_source(x), ss.RunOptions(mesh="data:1", microbatch=4))
    assert built.merge_route == merging.MergeRoute.PROCESS_TREE  # a pairwise merge, as Describe's and Quantiles'
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        got, report = ss.run_with_report(combiner, x, mesh="data:1", microbatch=4)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    np.testing.assert_array_equal(got, np.abs(x).max(0))
    assert compiled == ["jit(local_step)"] and report.devices == 1 and report.nonfinite_values == 1, compiled


@pytest.mark.parametrize("mesh", MESHES)
def test_user_combiner_with_collective_fold(mesh):
    x = rows(77, d=3)
    x[-1] = 100.0  # in the last, ragged step
    np.testing.assert_array_equal(ss.run(MaxAbs(), x, mesh=mesh, microbatch=4), np.abs(x).max(0))


def test_padding_never_counts():
    # Padding rows are zeros; a combiner that would see them gets a max of 0 < 1.
    x = -np.ones((13, 2), np.float32)

    class Min(MaxAbs):
        def add(self, acc, batch, mask):
            return jnp.minimum(acc, jnp.min(jnp.where(mask[:, None], batch, jnp.inf), axis=0))

        def init(self, spec):
            return jnp.full(spec.shape, jnp.inf)

        def merge(self, a, b):
            return jnp.minimum(a, b)

    np.testing.assert_array_equal(ss.run(Min(), x, microbatch=4), [-1.0, -1.0])


def compiled_step_and_merge(combiner, spec, mesh="data:8"):
    options = ss.RunOptions(mesh=mesh, microbatch=16, steps_per_call=4, compensated=False)
    prog = program.program_for_spec(combiner, spec, 10_000, options)
    return prog.lower_step().compile().as_text(), prog.lower_merge().compile().as_text(), prog


@pytest.mark.parametrize("combiner", [ss.Gram(), ss.Sum(), MaxAbs()])
def test_step_has_no_collective_and_merge_is_one(combiner):
    step, merge, prog = compiled_step_and_merge(combiner, jax.ShapeDtypeStruct((6,), np.float32))
    assert collectives(step) == []
    kinds = collectives(merge)
    if not combiner.additive:  # one process folds its devices' shards on one device: no collective
        assert prog.merge_route == "process_tree" and kinds == []
        return
    assert kinds and set(kinds) == {"all-reduce"}
    # XLA fuses the psum of a pytree into one all-reduce per dtype.
    assert len(kinds) <= 2


def test_run_merges_exactly_once(monkeypatch):
    calls = []
    real = merging.compile_psum_merge

    def counting(*args, **kwargs):
        merge = real(*args, **kwargs)
        return lambda *operands: calls.append(1) or merge(*operands)

    monkeypatch.setattr(merging, "compile_psum_merge", counting)
    ss.run(ss.Gram(), rows(5000), microbatch=8, steps_per_call=2)
    assert len(calls) == 1


def test_progress_reports_every_step():
    seen = []  # test_gram_and_sum_match_float64's program
    ss.run(ss.Sum(), rows(500), mesh="data:8", microbatch=8, steps_per_call=2, progress=seen.append)
    assert [p.step for p in seen] == [1, 2, 3, 4]  # 8 devices x 8 x 2 = 128 rows a step
    assert seen[-1].rows_done == 500 and seen[-1].total_steps == 4


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: ss.run(ss.Gram(), rows(10), mesh="data:16"), ["16", "8"]),
        (lambda: ss.run(ss.Gram(), rows(10), microbatch=0), ["microbatch"]),
        (lambda: ss.run(ss.Gram(), rows(10), microbatch=-3), ["microbatch"]),
        (lambda: ss.run(ss.Gram(), rows(10), steps_per_call=0), ["steps_per_call"]),
        (lambda: ss.run(ss.Gram(), rows(10), prefetch=-1), ["prefetch"]),
        (lambda: ss.run(ss.Gram(), rows(10), logical_shards=12), ["logical_shards=12", "8"]),
        (lambda: ss.run(ss.Gram(), rows(10), logical_shards=0), ["logical_shards"]),
        (lambda: ss.run(ss.Sum(), (rows(10), rows(9))), ["row counts"]),
        (lambda: ss.run(ss.Gram(), rows(10).reshape(10, 5, 1)), ["(d,)"]),
        (lambda: ss.run(ss.Gram(), (rows(10), rows(10))), ["one array"]),
        (lambda: ss.run(ss.Gram(), np.array([["a", "b"]])), ["numeric"]),
        (lambda: ss.run(ss.Gram(), rows(10).astype(np.complex64)), ["numeric"]),
        (lambda: ss.run(ss.Gram(), rows(0)), ["zero rows"]),
        (lambda: ss.run(ss.Sum(), np.float32(3.0)), ["scalar"]),
        (lambda: ss.run("gram", rows(10)), ["Combiner"]),
    ],
)
def test_bad_input_is_one_clear_line(call, words):
    with pytest.raises(ss.UsageError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("combiner", [ss.Gram(), MaxAbs()])
def test_logical_shards_are_bitwise_identical_on_every_device_count(combiner):
    # 8, 4 and 1 logical shards a device (data:4's 2 a device adds no kind); Gram's data:8 program is
    # test_device_counts' job's, which checks the same bits on backends of 1 and 2 devices
    x = rows(1009, d=6) * 3 + 1
    results = [ss.run(combiner, x, mesh=f"data:{d}", microbatch=8, logical_shards=8) for d in (1, 2, 8)]
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    assert rel_err(results[0], f64(x).T @ f64(x) if combiner.additive else np.abs(x).max(0)) < 1e-5


def test_rerun_on_same_mesh_is_bitwise_identical():
    x = rows(3001)  # test_gram_and_sum_match_float64's program, run twice more
    first = ss.run(ss.Gram(), x, mesh="data:8", microbatch=8, steps_per_call=2)
    np.testing.assert_array_equal(ss.run(ss.Gram(), x, mesh="data:8", microbatch=8, steps_per_call=2), first)
