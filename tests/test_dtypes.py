"""No value is narrowed on its way to the devices: 64-bit data runs in 64 bits with no flag (and
under the global x64 flag); on a backend without float64 it is one line naming dtype='float32'."""

import importlib

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import dtypes
from sharded_scan.engine import run_program
from sharded_scan.program import build_program
from sharded_scan.sources import SyntheticSource
from tests import cli
from tests.helpers import assert_usage_error, f64, rel_err


@pytest.mark.parametrize(
    "data, words",
    [
        (np.full((100, 2), 1e4, np.float64), ["float64", "float32", "no float64", "dtype='float32'"]),
        (np.arange(100, dtype=np.int64) + 2**40, ["int64", "int32", "x.astype(np.int32)"]),
        (np.arange(100, dtype=np.uint64), ["uint64", "uint32"]),
        ((np.ones((100, 2), np.float32), np.ones(100, np.float64)), ["float64"]),
    ],
)
def test_64_bit_data_on_a_backend_without_float64_is_one_line_before_compute(data, words, tmp_path, monkeypatch):
    monkeypatch.setattr(dtypes, "NO_FLOAT64", (jax.default_backend(),))  # as on a TPU
    combiner = ss.LinearRegression() if isinstance(data, tuple) else ss.Sum()
    assert_usage_error(lambda: ss.run(combiner, data, checkpoint=str(tmp_path / "c")), words)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ss.UsageError) as err:
        ss.run(combiner, data)
    assert "--config.data.dtype=" in err.value.cli and "astype" not in err.value.cli  # what the launcher prints


def test_the_launcher_prints_the_command_line_fix(tmp_path, monkeypatch):
    from launch.main import cli_wording, run_job

    monkeypatch.setattr(dtypes, "NO_FLOAT64", (jax.default_backend(),))
    config = importlib.import_module("configs.covariance").get_config("quick")
    config.data.dtype = "float64"
    with pytest.raises(ss.UsageError) as err, cli_wording():
        run_job(config, str(tmp_path / "w"))
    line = str(err.value)
    assert "--config.data.dtype=float32" in line and "astype" not in line and "\n" not in line, line
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_64_bit_data_runs_in_64_bits_with_no_flag(prefetch, tmp_path):
    rng = np.random.default_rng(0)
    y = rng.normal(1e4, 1e-3, size=(3000, 3))  # float32 would be ~1e-7 relative off (the variances: all of them)
    cov = ss.run(ss.Covariance(), y, mesh="data:3", microbatch=64, prefetch=prefetch)
    assert cov.cov.dtype == np.float64 and rel_err(cov.cov, np.cov(y, rowvar=False)) < 1e-9
    ids = (np.int64(2**40) + np.arange(30_000, dtype=np.int64) % 1000).reshape(-1, 1)
    s = ss.run(ss.Sum(), ids, microbatch=1000, prefetch=prefetch)
    assert int(s.sum[0]) == int(ids.sum()) and int(s.count) == len(ids)
    big = (np.uint64(2**63) + np.arange(1000, dtype=np.uint64)).reshape(-1, 1)
    assert ss.run(ss.Moments(), big, prefetch=prefetch).max[0] == float(big.max())
    directory = str(tmp_path / "c")  # resumed from a checkpoint (its final one: 6 steps), on another mesh
    ss.run(ss.Moments(), y, mesh="data:8", microbatch=64, checkpoint=ss.CheckpointOptions(directory, every_steps=3))
    again = ss.run(ss.Moments(), y, mesh="data:2", microbatch=64, checkpoint=directory, prefetch=prefetch)
    assert rel_err(again.var, y.var(0)) < 1e-9 and int(again.count) == len(y)
    assert not jax.config.jax_enable_x64  # scoped to the runs: the process's setting is untouched
    assert ss.run(ss.Sum(), np.ones((10, 2), np.float32)).sum.dtype == np.float32


def test_a_pandas_frame_of_default_dtypes_runs_with_no_flag():
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(1)
    df = pd.DataFrame({"f": rng.normal(1e6, 1e-4, 500), "i": rng.integers(2**40, 2**41, 500), "b": rng.random(500) < .3,
                       "j": rng.integers(0, 100, 500).astype(np.int32)})
    got = ss.run(ss.Moments(), df)
    want = df.to_numpy(np.float64)
    assert list(got.columns) == ["f", "i", "b", "j"]
    assert rel_err(got.mean, want.mean(0)) < 1e-14 and rel_err(got.var, want.var(0)) < 1e-9


def test_a_float64_job_is_not_a_float32_one(tmp_path):
    x = np.random.default_rng(2).normal(size=(10, 2))  # the float32 Sum of test_64_bit_data_runs_...: its programs
    directory = str(tmp_path / "c")
    ss.run(ss.Sum(), x.astype(np.float32), checkpoint=directory)
    assert_usage_error(lambda: ss.run(ss.Sum(), x, checkpoint=directory), ["different job"])


def test_compiled_programs_are_not_shared_between_32_and_64_bit_runs():
    x = (np.arange(4000, dtype=np.int32) % 3 + 2**30).reshape(-1, 1)
    accumulators = []
    for x64 in (True, False, True):  # int32 data under x64 accumulates in float64, else in float32
        with jax.enable_x64(x64):
            program = build_program(ss.Moments(), ss.sources.as_source(x), ss.RunOptions())
            got = run_program(program, ss.sources.as_source(x))[0]
            accumulators.append({leaf.dtype for leaf in jax.tree.leaves(program.init())})
        assert rel_err(got.mean, x.mean(0)) < 1e-7 and int(got.count) == len(x)
    assert np.dtype(np.float64) in accumulators[0] and np.dtype(np.float64) not in accumulators[1]
    assert accumulators[0] == accumulators[2]


def test_narrower_dtypes_are_placed_as_they_are():
    # One run of a tuple of the seven (each leaf placed in its own dtype): one compiled program, not seven.
    dtypes = (np.int8, np.uint8, np.int16, np.uint32, np.float16, np.float32, np.bool_)
    xs = tuple((np.arange(60) % 7).astype(dtype).reshape(30, 2) for dtype in dtypes)
    got = ss.run(ss.Sum(), xs, microbatch=4)
    assert len(got.sum) == len(dtypes) and int(got.count) == 30
    for dtype, x, total in zip(dtypes, xs, got.sum, strict=True):
        np.testing.assert_array_equal(total, x.astype(np.float64).sum(0), err_msg=str(dtype))


def test_the_cli_runs_float64_data_in_float64_under_config_x64(tmp_path):
    args = ("--config=configs/covariance.py:quick", "--config.x64=True", "--config.data.dtype=float64")
    proc = cli.run(cli.main_cmd(*args, f"--workdir={tmp_path}"))
    assert proc.returncode == 0, proc.stderr
    got = cli.result(tmp_path)
    config = cli.summary(tmp_path)["config"]
    assert config["x64"] is True and config["precision"] == "highest"
    data = config["data"]
    n = data["num_rows"]
    x = SyntheticSource(n, data["features"], dtype="float64", seed=data["seed"]).read(0, n)
    assert got["cov"].dtype == np.float64
    assert rel_err(got["cov"], np.cov(f64(x), rowvar=False)) < 1e-12


def test_the_x64_help_line_says_what_a_job_does_with_and_without_the_flag(tmp_path):
    # Issue 43: --help said "--config.x64 ... (without it such data is refused in one line)"; float64 ran fine
    # without it. The line's two claims, checked against what the jobs do.
    from launch.help import config_fields
    from launch.main import run_job

    config = importlib.import_module("configs.covariance").get_config("quick")
    meaning = {field: text for field, _, text in config_fields(config)}["x64"]
    assert "refused" not in meaning
    assert "64-bit data (float64, int64) and 32-bit integers are reduced in 64 bits either way" in meaning
    config.data.dtype = "float64"
    assert config.x64 is False
    got, _ = run_job(config, str(tmp_path / "w"))
    data = config.data
    x = SyntheticSource(data.num_rows, data.features, dtype="float64", seed=data.seed).read(0, data.num_rows)
    assert got.cov.dtype == np.float64 and rel_err(got.cov, np.cov(x, rowvar=False)) < 1e-12

    # 32-bit integers past float32's 2^24: reduced in float64 with the flag or without it (float32 rounded them)
    ints = (np.arange(64, dtype=np.int32) * 7 + 2**24 + 1).reshape(32, 2)
    want = f64(ints).T @ f64(ints)
    plain = ss.run(ss.Gram(), ints, microbatch=8)
    with jax.enable_x64(True):  # what --config.x64=True sets for the whole process
        wide = ss.run(ss.Gram(), ints, microbatch=8)
    assert plain.dtype == np.float64 and np.array_equal(plain, want)
    assert wide.dtype == np.float64 and np.array_equal(wide, want)


def test_placing_64_bit_rows_outside_a_run_is_refused_not_narrowed():
    from sharded_scan.prefetch import device_batches

    x = np.arange(64, dtype=np.float64).reshape(32, 2)
    with jax.enable_x64(True):
        program = build_program(ss.Sum(), ss.sources.as_source(x), ss.RunOptions(microbatch=8))
        placed = next(device_batches(ss.sources.as_source(x), program.layout, program.mesh))
    assert placed.batch.dtype == np.float64
    assert_usage_error(lambda: next(device_batches(ss.sources.as_source(x), program.layout, program.mesh)),
                       ["float64", "float32"])
