"""No value is narrowed on its way to the devices: 64-bit data needs x64, and runs in 64 bits with it."""

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.sources import SyntheticSource
from tests import cli
from tests.helpers import assert_usage_error, f64, rel_err


@pytest.mark.parametrize(
    "data, words",
    [
        (np.full((100, 2), 1e4, np.float64), ["float64", "float32", "jax_enable_x64", "--config.x64=True"]),
        (np.arange(100, dtype=np.int64) + 2**40, ["int64", "int32", "jax_enable_x64"]),
        (np.arange(100, dtype=np.uint64), ["uint64", "uint32"]),
        ((np.ones((100, 2), np.float32), np.ones(100, np.float64)), ["float64"]),
    ],
)
def test_64_bit_data_without_x64_is_one_line_before_compute(data, words, tmp_path):
    combiner = ss.LinearRegression() if isinstance(data, tuple) else ss.Sum()
    assert_usage_error(lambda: ss.run(combiner, data, checkpoint=str(tmp_path / "c")), words)
    assert not (tmp_path / "c").exists()


def test_narrower_dtypes_are_placed_as_they_are():
    for dtype in (np.int8, np.uint8, np.int16, np.uint32, np.float16, np.float32, np.bool_):
        x = (np.arange(60) % 7).astype(dtype).reshape(30, 2)
        got = ss.run(ss.Sum(), x, microbatch=4)
        np.testing.assert_array_equal(got.sum, x.astype(np.float64).sum(0))


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


@pytest.mark.parametrize("combiner", [ss.Quantiles(qs=[0.5]), ss.DistinctCount(), ss.TopK(k=3)])
def test_sketches_refuse_64_bit_values_under_x64_instead_of_merging_them(combiner, tmp_path):
    # Keyed in 32 bits, 100,000 distinct float64 values near 1e9 were counted as 3 ("exact").
    import jax

    with jax.enable_x64(True):
        for data, words in (
            (1e9 + np.arange(1000.0)[:, None] * 1e-3, ["float64", "32 bits", "float32"]),
            (np.arange(1000, dtype=np.int64)[:, None] + 2**40, ["64-bit integers", "int32"]),
        ):
            assert_usage_error(lambda data=data: ss.run(combiner, data, checkpoint=str(tmp_path / "c")), words)
    assert not (tmp_path / "c").exists()
