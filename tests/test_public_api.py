"""The design's public contract: every stable name imports from where it is promised."""

import ast
import configparser
import functools
import pathlib
import re
import tomllib

import numpy as np

import sharded_scan as ss
from sharded_scan import combiners

CONTRACT = [
    "make_mesh", "run", "UsageError", "Combiner", "AdditiveCombiner",
    "Sum", "Gram", "Covariance", "Correlation", "Moments", "PCA", "LinearRegression", "Histogram", "Gradient",
    "from_fn",
    "Quantiles", "DistinctCount", "TopK", "hash_strings", "RunOptions", "StorageError",
    "run_in_workdir", "Describe", "GroupBy", "Weighted",
    "from_datasketches", "counts", "NonFiniteError", "Terminated", "ReadError", "Preempted",
]
ROOT = pathlib.Path(ss.__file__).parent.parent
PACKAGES = ("sharded_scan", "launch", "configs")  # what setup.cfg installs
# Exceptions the library raises but catches itself, never reaching a user.
CAUGHT_INSIDE = {"Damaged", "UnkeyableError"}  # checkpoint_store: a damaged checkpoint, set aside by the restore;
# executables: a job the job-keyed cache cannot key (its step is traced)
# Standard-library names the code may use, and the Python that brought them (3, minor).
NEWER_STDLIB = {"StrEnum": 11, "tomllib": 11, "Self": 11, "ExceptionGroup": 11, "TaskGroup": 11,
                "batched": 12, "override": 12, "TypeAliasType": 12}
RESULT_FIELDS = {
    "SumResult": ("sum", "count", "columns"),
    "WeightedSumResult": ("sum", "count", "weight", "columns"),
    "GroupByResult": ("result", "rows", "keys", "by"),
    "CovarianceResult": ("count", "mean", "cov", "columns", "pair_count"),
    "CorrelationResult": ("count", "mean", "corr", "columns", "pair_count"),
    "MomentsResult": ("count", "mean", "var", "min", "max", "skewness", "kurtosis", "nan_count", "zeros", "norm_l1",
                      "norm_l2", "columns"),
    "PCAResult": ("components", "explained_variance", "explained_variance_ratio", "mean", "singular_values", "columns"),
    "LinearRegressionResult": ("coef", "intercept", "rank", "cond", "r2", "residual_std", "coef_stderr",
                               "intercept_stderr", "columns"),
    "HistogramResult": ("counts", "edges", "columns"),
    "GradientResult": ("count", "loss", "grad"),
    "QuantilesResult": ("quantiles", "qs", "count", "rank_error", "passes", "sketch", "columns"),
    "DistinctCountResult": ("count", "exact", "relative_error", "sketch", "columns"),
    "TopKResult": ("values", "counts", "errors", "bound", "certain", "sketch", "columns"),
    "DescribeResult": ("count", "nan_count", "mean", "std", "min", "max", "percentiles", "qs", "rank_error", "passes",
                       "columns"),
}


def test_contract_names_are_exported():
    for name in CONTRACT:
        assert name in ss.__all__, name
        assert getattr(ss, name) is not None
    assert set(ss.__all__) <= set(dir(ss))
    assert set(combiners.__all__) <= set(dir(combiners))


def test_result_field_names_are_the_contracts():
    for name, fields in RESULT_FIELDS.items():
        assert name in combiners.__all__, name
        assert getattr(combiners, name)._fields == fields


def test_builtins_are_combiners_and_the_additive_ones_say_so():
    built = {
        "Sum": ss.Sum(), "Gram": ss.Gram(), "Covariance": ss.Covariance(), "Correlation": ss.Correlation(),
        "Moments": ss.Moments(),
        "PCA": ss.PCA(1), "LinearRegression": ss.LinearRegression(), "Histogram": ss.Histogram(2, (0, 1)),
        "Gradient": ss.Gradient(lambda p, x: x @ p, np.ones(2, np.float32)),
        "from_fn": ss.from_fn(lambda c, b: c + b.sum(0), np.zeros(2, np.float32)),
        "Quantiles": ss.Quantiles(qs=[0.5]), "DistinctCount": ss.DistinctCount(), "TopK": ss.TopK(),
        "Describe": ss.Describe(),
    }
    additive = {"Sum", "Gram", "Histogram", "Gradient", "from_fn"}
    for name, combiner in built.items():
        assert isinstance(combiner, ss.Combiner), name
        assert combiner.additive == (name in additive), name
        assert combiner.fingerprint()["combiner"] in (name, "from_fn")


def declared_minor() -> int:
    """The minor version of setup.cfg's ``python_requires = >=3.MINOR``."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    declared = re.fullmatch(r">=\s*3\.(\d+)", cfg["options"]["python_requires"].strip())
    assert declared, cfg["options"]["python_requires"]
    return int(declared.group(1))


@functools.cache
def package_trees() -> tuple[tuple[pathlib.Path, ast.Module], ...]:
    """Every installed source, parsed with the syntax of the Python setup.cfg declares (once for both tests)."""
    paths = sorted(p for d in PACKAGES for p in (ROOT / d).rglob("*.py"))
    return tuple((p, ast.parse(p.read_text(), str(p), feature_version=(3, declared_minor()))) for p in paths)


def library_trees():
    return [(path, tree) for path, tree in package_trees() if path.relative_to(ROOT).parts[0] == "sharded_scan"]


def test_every_exception_the_library_raises_is_exported_and_the_old_homes_are_gone():
    base = {"Exception", "BaseException", "ValueError", "OSError", "RuntimeError", "KeyError", "TypeError"}
    bases, raised = {}, set()
    for _, tree in library_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}
            if isinstance(node, ast.Raise) and node.exc is not None:
                call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                raised.add(getattr(call, "id", getattr(call, "attr", None)))
    exceptions = set(base)
    while grown := {name for name, of in bases.items() if of & exceptions} - exceptions:
        exceptions |= grown
    ours = (raised & exceptions) - base - CAUGHT_INSIDE
    assert ours >= {"UsageError", "StorageError", "NonFiniteError", "Preempted", "Terminated", "ReadError"}, ours
    for name in ours:
        assert name in ss.__all__ and issubclass(getattr(ss, name), BaseException), name
        assert getattr(ss, name).__doc__, name
    # one home a name: no import kept only so an old path still works (0.1.0 has no users of old paths)
    kept = [f"{path.name}: {line.strip()}" for path, _ in library_trees() for line in path.read_text().splitlines()
            if "noqa: F401" in line and "loads the submodule" not in line and "import pyarrow" not in line]
    assert kept == [], kept
    assert not hasattr(ss, "run_passes")  # run and run_with_report run a reduction of several passes
    # a user's combiner counts rows exactly with the public counts
    assert {"zeros", "count_rows", "to_int", "sum_rows"} <= set(dir(ss.counts)) and "sharded_scan.counts" in (
        ss.counts.__doc__)


def test_python_requires_matches_the_features_the_code_uses():
    minor = declared_minor()
    used = {}
    for path, tree in package_trees():  # parsed with the syntax of 3.minor: a newer construct fails here
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    for part in (alias.name.split(".")[-1], *(getattr(node, "module", None) or "").split(".")):
                        if part in NEWER_STDLIB:
                            used[part] = path.name
            elif name in NEWER_STDLIB:
                used[name] = path.name
    needs = max([NEWER_STDLIB[n] for n in used] or [0])
    assert minor >= needs, f"setup.cfg says python_requires >=3.{minor}, but the code uses {used}: 3.{needs}"
    assert used.get("StrEnum") and minor >= 11  # program.py's enum.StrEnum
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["target-version"]
    assert ruff == f"py3{minor}", ruff  # the linter checks the same Python


def test_combiner_families_are_designs_rooms_and_import_down_the_list():
    """DESIGN.md's Rooms name combiners/'s sub-packages as the tree has them; a combiner module imports the rooms
    below it only: errors, dtypes, mesh and the combiner rooms listed before its own (never layout)."""
    rooms = re.findall(r"^- `combiners/(\w*)/?` —", (ROOT / "DESIGN.md").read_text(), re.M)
    families = {p.parent.name for p in (ROOT / "sharded_scan" / "combiners").glob("*/__init__.py")}
    assert rooms[0] == "" and sorted(rooms[1:]) == sorted(families), (rooms, families)
    rank = {room: i for i, room in enumerate(rooms)}
    wrong = []
    for path, tree in library_trees():
        parts = path.relative_to(ROOT).parts
        if parts[:2] != ("sharded_scan", "combiners") or parts[2:] == ("__init__.py",):
            continue  # combiners/__init__.py gathers the public names of every family
        own = parts[2] if len(parts) > 3 else ""
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [
                a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in (n.split(".") for n in names if n.startswith("sharded_scan.")):
                room = (name[2] if len(name) > 2 and name[2] in families else "") if name[1] == "combiners" else None
                if (room is None and name[1] not in ("errors", "dtypes", "mesh")) or (
                        room is not None and rank[room] > rank[own]):
                    wrong.append(f"{'/'.join(parts[1:])} imports {'.'.join(name)}")
    assert wrong == [], wrong


def test_counts_imports_as_a_module_of_its_own_name():
    import importlib

    assert importlib.import_module("sharded_scan.counts") is ss.counts
    from sharded_scan.counts import count_rows

    assert count_rows is ss.counts.count_rows
