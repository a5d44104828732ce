"""The launcher's config from the command line: shipped configs by name from anywhere, a user's own
combiner and its arguments, the user's own files (Parquet, CSV, npy with a y file), and the one
lines for the mistakes made on the way."""

import subprocess
import textwrap

import ml_collections
import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import Ridge

from launch import config_args
from launch.config_args import not_a_field
from launch.data import make_combiner, make_source
from launch.main import parse_flags
from tests import cli, forks
from tests.helpers import assert_usage_error

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

pytest.importorskip("pyarrow")

MY_COMBINER = textwrap.dedent('''
    import jax.numpy as jnp
    import sharded_scan as ss

    class ColumnMax(ss.Combiner):
        """Per-column maximum, times ``scale``."""

        def __init__(self, scale=1.0):
            self.scale = scale

        def init(self, spec):
            return jnp.full(spec.shape, -jnp.inf, spec.dtype)

        def add(self, acc, batch, mask):
            return jnp.maximum(acc, jnp.max(jnp.where(mask[:, None], batch, -jnp.inf), axis=0))

        def merge(self, a, b):
            return jnp.maximum(a, b)

        def finalize(self, acc):
            return acc * self.scale

    class NotACombiner:
        pass
''')
BROKEN_MODULE = "raise RuntimeError('this module is broken')\n"


def income_frame(rows=600, seed=0):
    """Data shaped like users': a large-mean column, an integer column, a string column, y."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "year": rng.integers(1990, 2024, rows).astype(np.int64),
        "income": rng.lognormal(10, 1, rows),
        "age": rng.normal(40, 12, rows),
        "city": rng.choice(["Lyon", "Köln"], rows),
    })
    frame["spend"] = 0.3 * frame["income"] - 20.0 * frame["age"] + 5.0 * (frame["year"] - 2000) + 100.0
    return frame


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """A user's directory (a space and non-ASCII in its name): their module and data files."""
    root = tmp_path_factory.mktemp("user") / "mes données"
    root.mkdir()
    (root / "my_stats.py").write_text(MY_COMBINER)
    (root / "broken_stats.py").write_text(BROKEN_MODULE)
    frame = income_frame()
    frame.to_parquet(root / "sales.parquet", row_group_size=128)
    frame.to_csv(root / "sales.csv", index=False)
    holes = frame.copy()
    holes.loc[[7, 300], "income"], holes.loc[[11, 500], "age"] = np.nan, np.nan  # issue 42's finding 4, in a file
    holes.to_parquet(root / "sales_nan.parquet", row_group_size=128)
    x = frame[["year", "income", "age"]].to_numpy(np.float64)
    assert x.flags.f_contiguous  # as pandas gives it: np.save keeps Fortran order
    np.save(root / "X.npy", x)  # float64, as the Parquet and CSV columns: the npy ridge runs their programs
    np.save(root / "y.npy", frame["spend"].to_numpy(np.float64))
    return root, frame


def launch(cwd, *args, devices=2):
    """``python -m launch.main ARGS`` started in ``cwd`` (not the repository), a fresh interpreter (no fork)."""
    return subprocess.run(cli.main_cmd(*args, devices=devices), cwd=cwd, env=cli.env(), capture_output=True,
                          text=True, timeout=cli.TIMEOUT)


@pytest.fixture(scope="module")
def runs(user_files):
    """The module's launcher runs, started at once from the user's directory."""
    root, _ = user_files
    x64 = "--config.x64=True"
    cases = {
        "parquet": ("--config=ridge:quick", "--config.data.kind=parquet", f"--config.data.path={root}/sales.parquet",
                    "--config.data.columns=year,income,age", "--config.data.target=spend", x64,
                    "--config.combiner.kwargs.l2=0.5"),
        "csv": ("--config=configs/ridge.py:quick", "--config.data.kind=csv", f"--config.data.path={root}/sales.csv",
                "--config.data.target=spend", x64, "--config.combiner.kwargs.l2=0.5"),
        "npy": ("--config=ridge", "--config.data.kind=npy", f"--config.data.path={root}/X.npy",
                f"--config.data.target_path={root}/y.npy", "--config.combiner.kwargs.l2=0.5",
                "--config.microbatch=16", "--config.steps_per_call=2"),  # the quick layout, as parquet's
        "mine": ("--config=gram:quick", "--config.combiner.name=my_stats:ColumnMax",
                 "--config.combiner.kwargs.scale=2", "--config.data.kind=npy", f"--config.data.path={root}/X.npy"),
        "nan": ("--config=linreg:quick", "--config.data.kind=parquet", f"--config.data.path={root}/sales_nan.parquet",
                "--config.data.columns=year,income,age", "--config.data.target=spend", x64),  # parquet's programs
    }
    for name, args in cases.items():
        cases[name] = (*args, f"--workdir={root}/runs/{name}")
    # parquet, csv and npy are the same job's programs (float64 x and y, 64-bit with or without config.x64;
    # ridge's quick layout): parquet first, then csv and npy load its compiled programs from the compilation
    # cache instead of compiling them too (measured: all 6 programs from the cache, ~4 s of CPU less each)
    # mine's: python -m launch.main itself, started in the user's directory (their module imported from there); the
    # others (claims on the launcher's reading of files and its done: line): processes forked from one that
    # imported the launcher (the module's fork server, tests/forks.py), ~1.1 s of CPU of imports less each
    with cli.concurrent.futures.ThreadPoolExecutor(2) as pool:
        mine = pool.submit(launch, root, *cases["mine"])
        procs = {"parquet": cli.run(cli.main_cmd(*cases["parquet"], devices=2), cwd=root), "mine": mine.result()}
    names = ["csv", "npy", "nan"]
    procs.update(zip(names, cli.run_forked([cli.main_cmd(*cases[name], devices=2) for name in names], cwd=root),
                     strict=True))
    return procs


def test_a_fit_over_rows_holding_nan_is_nan_and_the_done_line_says_which_policy_to_use(user_files, runs):
    # Issue 42, finding 4: the CLI wrote coefficients 0 (result.csv: `a,0.0,nan`, 200,000 rows) after one WARNING
    # line, or (these 600 rows) failed the solve with status 2. Now the fit is NaN and the done: line says where the
    # NaN came from and what to run instead; status 0.
    root, _ = user_files
    proc, workdir = runs["nan"], root / "runs" / "nan"
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = cli.result(workdir)
    assert np.isnan(got["coef"]).all() and np.isnan(got["r2"]) and got["rank"] == -1
    table = pd.read_csv(workdir / "result.csv")
    assert table["coef"].isna().all() and len(table) == 3
    done = [line for line in proc.stderr.splitlines() if "done: " in line]
    assert len(done) == 1, proc.stderr[-3000:]
    for words in ("the result holds NaN", "from rows holding NaN", "--config.nan_policy=omit",
                  "--config.nan_policy=raise"):
        assert words in done[0], done[0]
    assert cli.summary(workdir)["nonfinite_values"] > 0


@pytest.mark.parametrize("kind", ["parquet", "csv", "npy"])
def test_ridge_on_the_users_own_files_matches_sklearn(user_files, runs, kind):
    root, frame = user_files
    proc = runs[kind]
    assert proc.returncode == 0, proc.stderr[-3000:]
    x, y = frame[["year", "income", "age"]].to_numpy(), frame["spend"].to_numpy()
    want = Ridge(alpha=0.5).fit(x, y)
    got = cli.result(root / "runs" / kind)
    np.testing.assert_allclose(got["coef"], want.coef_, rtol=1e-9)
    np.testing.assert_allclose(got["intercept"], want.intercept_, rtol=1e-9)
    assert cli.summary(root / "runs" / kind)["config"]["combiner"]["kwargs"]["l2"] == 0.5
    want_columns = [0, 1, 2] if kind == "npy" else ["year", "income", "age"]  # names kept where the data has them
    assert got["columns"].tolist() == want_columns


def test_the_users_own_combiner_with_its_arguments(user_files, runs):
    root, frame = user_files
    assert runs["mine"].returncode == 0, runs["mine"].stderr[-3000:]
    want = 2 * frame[["year", "income", "age"]].to_numpy().max(axis=0)
    np.testing.assert_array_equal(cli.result(root / "runs" / "mine")["result"], want)


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """The module's command lines that end before a job runs, started in an empty directory (not the
    repository), each a process forked from one that imported the launcher (tests/cli.py's run_forked):
    ``({name: CompletedProcess}, that directory, the config file that does not parse)``."""
    anywhere = tmp_path_factory.mktemp("anywhere")
    broken = tmp_path_factory.mktemp("config") / "broken.py"
    broken.write_text("def get_config(arg=None):\n    return (\n")
    cases = {
        "list": ("--list_configs",),
        "print": ("--config=ridge:quick", "--print_config", "--config.combiner.kwargs.solver=tsqr",
                  "--config.microbatch=32"),
        "typo": ("--config=gram:quick", f"--workdir={anywhere}/a", "--config.microbtch=5"),
        "broken": (f"--config={broken}", f"--workdir={anywhere}/work"),
    }
    procs = cli.run_forked([cli.main_cmd(*args, devices=2) for args in cases.values()], cwd=anywhere)
    return dict(zip(cases, procs, strict=True)), anywhere, broken


def test_list_and_print_config_from_anywhere(ended):
    (procs, anywhere, _) = ended
    listed, printed = procs["list"], procs["print"]
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert {"gram", "ridge", "pca", "quantiles"} <= set(names) and "common" not in names
    assert printed.returncode == 0, printed.stderr
    assert "solver: tsqr" in printed.stdout and "microbatch: 32" in printed.stdout
    assert not list(anywhere.iterdir())  # printing writes nothing (nor do the mistakes of the tests below)


def parse_flags_line(capsys, *args):
    """The line and status of ``launch.main.parse_flags`` (the launcher's flag parsing) refusing ``args``, here:
    for mistakes ``config_args.split_args`` finds before absl reads any flag (nothing global is set yet)."""
    with pytest.raises(SystemExit) as exit_:
        parse_flags(["launch.main", *args])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def test_typos_and_unknown_names_are_one_readable_line(ended, tmp_path, capsys):
    # A field's typo is absl's and ml_collections' to find: the launcher's command line; the two mistakes
    # split_args finds go through the launcher's parse_flags in this process (~1.8 s of imports each saved)
    procs, anywhere, _ = ended
    line = cli.one_error_line(procs["typo"])
    assert line == "error: bad --config override: 'microbtch' is not a field of this config; did you mean " \
                   '"microbatch"?', line
    line = parse_flags_line(capsys, "--config=gramm", f"--workdir={tmp_path}/b")
    assert line.startswith("error: ") and "'gramm'" in line and "ridge" in line, line
    line = parse_flags_line(capsys, "--config=gram:quick", f"--workdir={tmp_path}/c", "--config.combiner.kwargs.block")
    assert line.startswith("error: ") and "NAME=VALUE" in line, line
    assert not list(tmp_path.iterdir()) and not (anywhere / "a").exists()


def test_not_a_field_without_a_suggestion():
    e = AttributeError(KeyError('Key "zz" does not exist and cannot be added since the config is locked.'))
    assert not_a_field(e) == ("bad --config override: 'zz' is not a field of this config; check the spelling "
                              "(--print_config lists them).")


def test_split_args_resolves_configs_and_reads_kwargs_as_literals(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    argv, extra = config_args.split_args([
        "prog", "--config=pca:quick", "--config.combiner.kwargs.k=3", "--config.combiner.kwargs.solver=tsqr",
        "--config.combiner.kwargs.range=(0, 1.5)", "--config.data.factory_kwargs.path=/a b", "--workdir=w",
    ])
    assert argv == ["prog", f"--config={config_args.CONFIG_DIR}/pca.py:quick", "--workdir=w"]
    assert extra == {"combiner.kwargs": {"k": 3, "solver": "tsqr", "range": (0, 1.5)},
                     "data.factory_kwargs": {"path": "/a b"}}
    assert config_args.resolve_config("configs/gram.py") == f"{config_args.CONFIG_DIR}/gram.py"
    (tmp_path / "mine.py").write_text("")
    assert config_args.resolve_config("mine.py:x") == "mine.py:x"  # the user's own file, as given
    assert_usage_error(lambda: config_args.resolve_config("common"), ["common", "gram"])


def test_combiner_by_name_refuses_in_one_line(user_files, monkeypatch):
    root, _ = user_files
    monkeypatch.syspath_prepend(str(root))
    config = ml_collections.ConfigDict({"name": "", "kwargs": {}})
    for name, kwargs, words in [
        ("my_stats:NotACombiner", {}, ["NotACombiner", "not a sharded_scan.Combiner"]),
        ("my_stats:Missing", {}, ["has no 'Missing'"]),
        ("no_such_module:X", {}, ["cannot import 'no_such_module'", "PYTHONPATH"]),
        ("broken_stats:X", {}, ["importing 'broken_stats' failed", "RuntimeError", "broken"]),
        ("my_stats:ColumnMax", {"scal": 2}, ["'scal'", "takes: scale"]),
        ("my_stats", {}, ["package.module:Class"]),
        ("Gramm", {}, ["'Gramm'", "Gram", "package.module:Class"]),
        ("Gram", {"d": 4}, ["'d'", "block"]),
    ]:
        config.name, config.kwargs = name, kwargs
        assert_usage_error(lambda: make_combiner(config), words)
    config.name, config.kwargs = "my_stats:ColumnMax", {"scale": 3}
    assert make_combiner(config).scale == 3


def test_file_kinds_name_x_and_y_or_say_what_is_missing(user_files):
    root, frame = user_files
    import configs.ridge

    data = configs.ridge.get_config("quick").data
    data.kind, data.path = "parquet", str(root / "sales.parquet")
    assert_usage_error(lambda: make_source(data), ["--config.data.target=COLUMN"])
    data.target = "spend"
    source = make_source(data)  # X: every numeric column but y (the string column left out)
    x, y = source.read(0, 5)
    np.testing.assert_array_equal(x, frame[["year", "income", "age"]].to_numpy()[:5])
    np.testing.assert_array_equal(y, frame["spend"].to_numpy()[:5])
    data.columns = "income,spend"
    assert_usage_error(lambda: make_source(data), ["spend", "also in config.data.columns"])
    data.columns = "income,city"
    assert_usage_error(lambda: make_source(data), ["city", "not a number"])
    data.kind, data.path, data.columns, data.target = "npy", str(root / "X.npy"), "", ""
    assert_usage_error(lambda: make_source(data), ["--config.data.target_path"])
    data.target = "spend"
    assert_usage_error(lambda: make_source(data), ["config.data.target", "npy", "parquet"])



def test_a_config_file_that_does_not_parse_is_one_line_with_its_file_and_line(ended):
    procs, anywhere, path = ended
    line = cli.one_error_line(procs["broken"])  # status 2, one line, no traceback
    assert line == f"error: bad --config: {path}, line 2: SyntaxError: '(' was never closed"
    assert not (anywhere / "work").exists()


@pytest.mark.parametrize("ddof", [None, -1, 0.5, True])
def test_a_ddof_that_is_not_a_count_is_one_line(ddof):
    import sharded_scan as ss

    for combiner in (ss.Moments(ddof=ddof), ss.Covariance(ddof=ddof)):
        assert_usage_error(lambda c=combiner: ss.run(c, np.ones((10, 2), np.float32)),
                           [f"{type(combiner).__name__} ddof must be a non-negative integer", repr(ddof)])
