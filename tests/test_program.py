"""The job resolved once: options written once, operands that reuse compiled programs, resumes
across mesh resolutions and of sequential sources, and the matmul precision of every step."""

import dataclasses
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import threadpoolctl

import sharded_scan as ss
from configs import gram as gram_config
from sharded_scan import compiled
from sharded_scan.options import config_fields
from sharded_scan.program import program_for_spec
from tests import jobs
from tests.helpers import assert_usage_error, f64, rel_err


class Stop(Exception):  # noqa: N818 - not an error: a stand-in for a kill
    """Stands for a crash between two steps."""


def stop_after(steps):
    def progress(p):
        if p.step >= steps:
            raise Stop

    return progress


def crash_after(steps, combiner, data, **options):
    with pytest.raises(Stop):
        ss.run(combiner, data, progress=stop_after(steps), **options)


def rows(n, d, seed=0):
    return (np.random.default_rng(seed).normal(size=(n, d)) + 3).astype(np.float32)


def test_configs_carry_every_plain_option_with_the_engines_default():
    config = gram_config.get_config()
    for name, (default, _) in config_fields().items():
        assert config[name] == default, name
    quick = gram_config.get_config("quick")
    assert (quick.microbatch, quick.steps_per_call) == (16, 2)
    plain = set(config_fields())
    assert plain == {f.name for f in dataclasses.fields(ss.RunOptions)} - {"checkpoint", "progress", "step_timeout"}


def test_an_options_object_and_overrides_give_the_same_run():
    x = rows(1001, 3)
    by_object = ss.run(ss.Sum(), x, ss.RunOptions(microbatch=4, mesh="data:2"))
    by_keywords = ss.run(ss.Sum(), x, microbatch=4, mesh="data:2")
    mixed = ss.run(ss.Sum(), x, ss.RunOptions(microbatch=4), mesh="data:2")
    for got in (by_keywords, mixed):
        np.testing.assert_array_equal(got.sum, by_object.sum)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"microbtch": 4}, ["'microbtch'", "'microbatch'"]),
        ({"precision": "fast"}, ["precision", "highest"]),
        ({"progress": 3}, ["progress"]),
        ({"step_timeout": -1}, ["step_timeout"]),
    ],
)
def test_a_bad_option_is_one_line(options, words):
    assert_usage_error(lambda: ss.run(ss.Sum(), rows(10, 2), **options), words)


@pytest.mark.parametrize(
    "num_rows, options, runs",
    [
        (100_000, {"microbatch": 1024, "logical_shards": 8}, 256),  # reproducible shards fold 256 rows at a time
        (40, {"microbatch": 1024}, 8),  # 40 rows over 8 devices: no step padded out to 8 x 1024 rows, but to 8 x 8
        (3000, {"microbatch": 1024}, 512),  # 375 rows a shard: the power of two above, as for every 257..512
        (100_000, {"microbatch": 1024}, 1024),
    ],
)
def test_the_fingerprint_names_the_micro_batch_the_programs_run(num_rows, options, runs):
    prog = program_for_spec(ss.Sum(), jax.ShapeDtypeStruct((3,), np.float32), num_rows, ss.RunOptions(**options))
    assert prog.layout.microbatch == prog.fingerprint["microbatch"] == runs
    step = prog.lower_step().as_text()
    assert re.search(rf"tensor<{runs}x3xf32>", step), "the step folds micro-batches of that many rows"


@pytest.mark.parametrize(
    "d, chain",
    [(30, ["data:4,model:2", "data:2,model:4", "data:8"]), (40, ["data:8", "data:4,model:2", "data:1"])],
)
def test_gram_resumes_across_model_axes_bitwise(tmp_path, d, chain):
    x = rows(6000, d)
    options = dict(microbatch=32, steps_per_call=2, logical_shards=8)  # 512 rows a step
    want = ss.run(ss.Gram(), x, mesh=chain[-1], **options)
    checkpoint = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    for mesh in chain[:-1]:  # each run saves 2 steps, then crashes
        crash_after(3, ss.Gram(), x, mesh=mesh, checkpoint=checkpoint, **options)
    got, report = ss.run_with_report(ss.Gram(), x, mesh=chain[-1], checkpoint=checkpoint, **options)
    assert report.resumed_from_cursor == 4 * 512
    np.testing.assert_array_equal(got, want)
    assert not (tmp_path / "damaged").exists()


def test_gram_resumes_from_a_model_mesh_onto_more_shards(tmp_path):
    x = rows(6000, 30)
    checkpoint = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    crash_after(3, ss.Gram(), x, mesh="data:4,model:2", microbatch=32, steps_per_call=2, checkpoint=checkpoint)
    got, report = ss.run_with_report(
        ss.Gram(), x, mesh="data:8", microbatch=32, steps_per_call=2, checkpoint=checkpoint
    )
    assert report.resumed_from_cursor > 0
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-6


@pytest.fixture
def compiles():
    """The programs built from here on: XLA compilations, and loads from the persistent
    compilation cache (tests/conftest.py turns it on; a hit would hide a compile)."""
    seen = []

    def listen(event, seconds, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


def test_new_gradient_params_reuse_the_compiled_programs(compiles):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3000, 4)).astype(np.float32), rng.normal(size=(3000,)).astype(np.float32)

    def loss(params, batch):
        features, target = batch
        return (features @ params["w"] + params["b"] - target) ** 2

    def gradient(params):
        return ss.run(ss.Gradient(loss, params), (x, y), microbatch=64)

    gradient({"w": np.zeros(4, np.float32), "b": np.float32(0)})
    first = len(compiles)
    for step in range(1, 4):
        w, b = rng.normal(size=4).astype(np.float32), np.float32(step)
        got = gradient({"w": w, "b": b})
        residual = f64(x) @ w + b - f64(y)
        assert rel_err(got.grad["w"], 2 * f64(x).T @ residual / len(x)) < 1e-5
        assert rel_err(got.loss, np.mean(residual**2)) < 1e-5
    assert len(compiles) == first, "a new params value compiled again"


def test_another_histogram_range_reuses_the_compiled_programs(compiles):
    x = rows(2000, 3)
    ss.run(ss.Histogram(8, (-1.0, 7.0)), x, microbatch=64)
    first = len(compiles)
    for lo, hi in [(0.0, 5.0), (2.5, 3.5)]:
        got = ss.run(ss.Histogram(8, (lo, hi)), x, microbatch=64)
        for j in range(3):
            np.testing.assert_array_equal(got.counts[j], np.histogram(x[:, j], 8, (lo, hi))[0])
    assert len(compiles) == first


def test_small_jobs_of_other_row_counts_reuse_the_compiled_programs(compiles):
    """A job smaller than one step runs a canonical micro-batch (layout.small_step_size), so the ragged row counts
    users and generated tests meet share its programs; the padding rows fold nothing: not into counts, min/max,
    NaN counts or a sketch."""
    rng = np.random.default_rng(3)
    data = rng.normal(size=(64, 3)).astype(np.float32) * 1e3
    data[rng.integers(0, 64, 12), rng.integers(0, 3, 12)] = [np.nan, np.inf, -np.inf, -0.0] * 3
    jobs = (ss.Moments(), ss.Quantiles(qs=[0.0, 0.5, 1.0], method="lower"))
    first = None
    for n in (64, 1, 9, 17, 33, 50):  # 8, 1, 2, 3, 5 and 7 rows a device: each compiled its own step
        x = data[:n]
        kept = [x[np.isfinite(x[:, j]), j].astype(np.float64) for j in range(3)]
        moments, quantiles = (ss.run(job, x, nan_policy="omit") for job in jobs)
        np.testing.assert_array_equal(moments.count, [len(k) for k in kept])
        np.testing.assert_array_equal(moments.nan_count, np.isnan(x).sum(axis=0))
        for j, k in enumerate(kept):
            if len(k):
                assert (moments.min[j], moments.max[j]) == (k.min(), k.max())
                assert abs(moments.mean[j] - k.mean()) <= 1e-5 * np.abs(k).mean()  # float32 sums
        for j, k in enumerate(kept):  # Quantiles, as Moments, skips each NaN or inf where it stands
            want = np.quantile(k, [0, 0.5, 1], method="lower") if len(k) else np.full(3, np.nan)
            np.testing.assert_array_equal(quantiles.quantiles[j], want)
        first = len(compiles) if first is None else first
    assert len(compiles) == first, "another row count compiled its own programs"


def test_an_iterator_source_resumes_exactly_once_after_a_crash(tmp_path):
    options = dict(microbatch=64, steps_per_call=1, mesh="data:4")  # 256 rows a step
    want = ss.run(ss.Covariance(), jobs.iterator_source(), **options)
    checkpoint = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    crash_after(3, ss.Covariance(), jobs.iterator_source(), checkpoint=checkpoint, **options)
    got, report = ss.run_with_report(ss.Covariance(), jobs.iterator_source(), checkpoint=checkpoint, **options)
    assert report.resumed_from_cursor == 2 * 256 and report.rows_this_run == 5000 - 512
    for field, a, b in zip(want._fields, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=field)
    everything = jobs.ResumableBatches(5000, 3).all_rows()
    assert rel_err(got.cov, np.cov(f64(everything), rowvar=False)) < 1e-5


def test_the_issues_iterator_example_resumes(tmp_path):
    checkpoint = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    options = dict(microbatch=256, steps_per_call=1, checkpoint=checkpoint)
    crash_after(3, ss.Sum(), jobs.iterator_source(), **options)
    got = ss.run(ss.Sum(), jobs.iterator_source(), **options)
    assert int(got.count) == 5000
    assert rel_err(got.sum, f64(jobs.ResumableBatches(5000, 3).all_rows()).sum(0)) < 1e-6


def loss_with_a_matmul(params, batch):
    return (batch @ params) ** 2


def row(*shape):
    return jax.ShapeDtypeStruct(shape, np.float32)


DOT_BUILTINS = {
    "Gram dense": (lambda: ss.Gram(), row(8)),
    "Gram blocked": (lambda: ss.Gram(block=4), row(10)),
    "Covariance": (lambda: ss.Covariance(), row(6)),
    "PCA": (lambda: ss.PCA(2), row(6)),
    "LinearRegression": (lambda: ss.LinearRegression(), (row(5), row())),
    "Gradient": (lambda: ss.Gradient(loss_with_a_matmul, np.ones(6, np.float32)), row(6)),
    "from_fn": (lambda: ss.from_fn(lambda c, b: c + b.T @ b, jnp.zeros((6, 6))), row(6)),
}
PRECISION = re.compile(r"dot_general.*?precision = \[(\w+), (\w+)\]")


@pytest.mark.parametrize("name", sorted(DOT_BUILTINS))
@pytest.mark.parametrize("precision, expected", [("highest", "HIGHEST"), ("default", "DEFAULT")])
def test_every_matmul_of_a_step_runs_at_the_run_precision(name, precision, expected):
    make, spec = DOT_BUILTINS[name]
    options = ss.RunOptions(mesh="data:2", microbatch=8, steps_per_call=2, precision=precision)
    prog = program_for_spec(make(), spec, 100, options)
    for text in (prog.lower_step().as_text(), prog.lower_merge().as_text()):
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert all(PRECISION.search(line).groups() == (expected, expected) for line in dots), dots
    assert any("dot_general" in line for line in prog.lower_step().as_text().splitlines())


class OneScanSum(ss.Sum):
    one_scan_per_step = True  # a user's combiner asks for it (Sum's add is cheap to compile: for the test)


def test_a_combiner_that_asks_for_one_scan_a_step_gets_one_and_small_steps_get_one():
    # A step whose shard holds only real rows takes a copy of the scan with a constant mask, unless the
    # combiner (here inside the Compensated wrapper, which forwards the attribute) says one_scan_per_step,
    # or the shard's block is small (fewer than compiled.TWO_SCANS_FROM_ROWS rows: one scan, half the compile).
    scans = {}
    for microbatch, steps_per_call in ((2048, 2), (4, 2)):
        options = ss.RunOptions(mesh="data:1", microbatch=microbatch, steps_per_call=steps_per_call)
        steps = [program_for_spec(c, row(2), 8192, options).lower_step().as_text() for c in (ss.Sum(), OneScanSum())]
        scans[microbatch * steps_per_call] = [text.count("stablehlo.while") for text in steps]
    assert scans == {4096: [2, 1], 8: [1, 1]}


@dataclasses.dataclass(frozen=True)
class _BlasThreadsSeen(ss.Sum):
    """A Sum whose finalize notes the host BLAS's threads, as the run gives them."""

    seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def finalize(self, acc):
        self.seen.append(_blas_threads())
        return super().finalize(acc)


def _blas_threads() -> int:
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")


def test_finalize_runs_the_host_blas_on_one_thread_found_once_and_again_after_an_import():
    combiner, x = _BlasThreadsSeen(), np.ones((64, 3), np.float32)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        ss.run(combiner, x)
        found = compiled._blas
        ss.run(combiner, x)
        assert compiled._blas is found  # nothing imported between: the libraries are not scanned again
        sys.modules["tests._blas_probe_module"] = types.ModuleType("tests._blas_probe_module")
        try:
            ss.run(combiner, x)
            assert compiled._blas is not found  # a module imported since: scanned again
        finally:
            del sys.modules["tests._blas_probe_module"]
        assert combiner.seen == [1, 1, 1] and _blas_threads() == 2  # one thread in finalize, restored after
