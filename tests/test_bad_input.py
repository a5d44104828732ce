"""User mistakes through the CLI and the API: one clear line, before any compute or write.

Every case runs against a workdir that already holds a finished job's checkpoints and
outputs, and checks they are byte-for-byte unchanged afterwards (the CLI cases all at once,
each on its own copy of that workdir). A mistake the job meets once its flags are read goes
through the launcher's own end in this process (``exits`` and ``cli_wording`` around
``run_job``, as ``launch.main`` runs it: status 2, one ``error:`` line); the command lines
below cover what only a process shows (flags, devices, start-up). Run with ``-s`` to see
the table of input -> message.
"""

import hashlib
import importlib
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from launch.main import run_job
from sharded_scan import distributed
from tests import cli
from tests.helpers import assert_usage_error, launcher_error_line

GRAM = "--config=configs/gram.py:quick"


def snapshot(directory):
    """Every file under ``directory`` with its bytes' hash: what 'untouched' means."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A workdir with a finished Gram job (checkpoints, result, summary) and bad input files.

    The job is GRAM's, run by the launcher's ``run_job`` in this process (what ``launch.main`` runs,
    writing the same files; no process of its own: ~2.5 s of CPU less)."""
    base = tmp_path_factory.mktemp("bad_input")
    workdir = base / "w"
    run_job(importlib.import_module("configs.gram").get_config("quick"), str(workdir))
    assert cli.checkpoints(workdir) and (workdir / "result.npz").exists() and (workdir / "summary.json").exists()
    files = base / "files"
    (files / "shards").mkdir(parents=True)
    np.save(files / "text.npy", np.array([["a", "b"], ["c", "d"]]))
    (files / "garbage.npy").write_bytes(b"this is not a numpy file at all")
    np.save(files / "shards" / "part-0.npy", np.zeros((10, 3), np.float32))
    np.save(files / "shards" / "part-1.npy", np.zeros((10, 4), np.float32))
    return workdir, files, base


CLI_CASES = [
    ("unknown nested config field", ["--config.data.colour=red"], ["'colour'", "not a field"]),
    ("wrong type for a field", ["--config.steps_per_call=1.5"], ["steps_per_call", "1.5"]),  # the field and value
    ("mesh that does not fit", ["--config.mesh=data:16"], ["data:16", "4 are present"]),
    ("bad coordinator address", ["--coordinator_address=nohost", "--num_processes=2", "--process_id=0"],
     ["--coordinator_address", "host:port", "nohost"]),
]
# Mistakes in the job's fields, met once the flags are read: GRAM's config with these fields set
# (as --config.FIELD=VALUE would), run through the launcher's end in this process.
JOB_CASES = [
    ("unknown combiner", {"combiner.name": "Gramm"}, ["Gramm"]),
    ("missing data file", {"data.kind": "npy", "data.path": "{files}/nope.npy"}, ["nope.npy"]),
    ("not a .npy file", {"data.kind": "npy", "data.path": "{files}/garbage.npy"}, ["garbage.npy"]),
    ("text dtype in a file", {"data.kind": "npy", "data.path": "{files}/text.npy"}, ["numeric"]),
    ("shards with different feature counts", {"data.kind": "npy_shards", "data.path": "{files}/shards"},
     ["part-1.npy"]),
    ("a file path for synthetic data", {"data.path": "{files}/text.npy"},
     ["config.data.path", "'synthetic'", "--config.data.kind=npy"]),
    ("fingerprint mismatch on resume", {"data.features": 9}, ["different job", "float32[9]"]),
    ("another config on resume", {"data.seed": 1}, ["different job", "data.seed"]),
]


@pytest.fixture(scope="module")
def cli_runs(job):
    """Every case's command, each on its own copy of the finished job, each a process forked from one that
    imported the launcher (tests/cli.py's ``run_forked``): ``{name: (CompletedProcess, args, workdir, its files
    before)}``."""
    workdir, files, base = job
    cases, cmds = {}, []
    for i, (name, args, _) in enumerate(CLI_CASES):
        copy = base / f"w{i}"
        shutil.copytree(workdir, copy)
        args = [a.format(files=files, base=base) for a in args]
        if not any(a.startswith("--workdir") for a in args):
            args.append(f"--workdir={copy}")
        cases[name] = (args, copy, snapshot(copy))
        cmds.append(cli.main_cmd(GRAM, *args))
    return {name: (proc, *case) for (name, case), proc in zip(cases.items(), cli.run_forked(cmds), strict=True)}


@pytest.mark.parametrize("name, words", [(c[0], c[2]) for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_mistake_is_one_line_and_touches_nothing(cli_runs, job, name, words):
    proc, args, workdir, before = cli_runs[name]
    base = job[2]
    line = cli.one_error_line(proc)  # status 2, one line, no traceback
    print(f"\n{' '.join(a.replace(str(base), '...') for a in args)} -> {line.replace(str(base), '...')}")
    for word in words:
        assert word in line, line
    assert snapshot(workdir) == before


@pytest.mark.parametrize("name, fields, words", JOB_CASES, ids=[c[0] for c in JOB_CASES])
def test_job_mistake_is_one_line_status_2_and_touches_nothing(job, name, fields, words, capsys):
    workdir, files, base = job
    copy = base / f"job {name}"
    shutil.copytree(workdir, copy)
    before = snapshot(copy)
    config = importlib.import_module("configs.gram").get_config("quick")
    fields = {field: value.format(files=files) if isinstance(value, str) else value for field, value in fields.items()}
    for field, value in fields.items():
        section, key = field.split(".")
        config[section][key] = value
    line = launcher_error_line(capsys, config, copy)
    given = " ".join(f"--config.{field}={value}" for field, value in fields.items())
    print(f"\n{given.replace(str(base), '...')} -> {line.replace(str(base), '...')}")
    for word in words:
        assert word in line, line
    assert snapshot(copy) == before


X = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)


def api_cases(ckdir, blocker=""):
    return [
        ("a scalar instead of rows", lambda: ss.run(ss.Gram(), np.float32(1), checkpoint=ckdir), ["scalar"]),
        ("data of strings", lambda: ss.run(ss.Gram(), np.array([["a"]] * 4), checkpoint=ckdir), ["numeric"]),
        ("leaves with different row counts", lambda: ss.run(ss.Sum(), (X, X[:7]), checkpoint=ckdir),
         ["different row counts"]),
        ("not a combiner", lambda: ss.run(np.sum, X, checkpoint=ckdir), ["Combiner"]),
        ("mesh without a data axis", lambda: ss.run(ss.Gram(), X, mesh="model:2", checkpoint=ckdir),
         ["'data' axis"]),
        ("microbatch 0", lambda: ss.run(ss.Gram(), X, microbatch=0, checkpoint=ckdir), ["microbatch"]),
        ("unknown nan_policy", lambda: ss.run(ss.Gram(), X, nan_policy="skip", checkpoint=ckdir), ["nan_policy"]),
        ("negative step_timeout", lambda: ss.run(ss.Gram(), X, step_timeout=-1, checkpoint=ckdir),
         ["step_timeout"]),
        ("fingerprint mismatch on resume", lambda: ss.run(ss.Gram(), X[:, :2], checkpoint=ckdir),
         ["different job", "data"]),
        ("checkpoint directory under a file", lambda: ss.run(ss.Gram(), X, checkpoint=f"{blocker}/ck"),
         ["not writable"]),
        ("a path instead of rows", lambda: ss.run(ss.Gram(), "X.npy", checkpoint=ckdir),
         ["path 'X.npy'", "NpySource(path)"]),
        ("a Parquet path instead of rows", lambda: ss.run(ss.Gram(), "data/part-0.parquet", checkpoint=ckdir),
         ["path 'data/part-0.parquet'", "ParquetSource(path, columns="]),
        ("a CSV path instead of rows", lambda: ss.run(ss.Gram(), "sales.csv", checkpoint=ckdir), ["CsvSource(path"]),
        ("a generator instead of rows", lambda: ss.run(ss.Gram(), (r for r in X), checkpoint=ckdir),
         ["generator", "IteratorSource(it, num_rows)"]),
        ("a list of lists", lambda: ss.run(ss.Gram(), X.tolist(), checkpoint=ckdir), ["Python list", "np.asarray"]),
        ("a masked array", lambda: ss.run(ss.Gram(), np.ma.masked_less(X, 0), checkpoint=ckdir),
         ["masked array", "masked entries", "x.filled(np.nan)", "nan_policy='omit'"]),
        ("a from_fn body that is a running max",
         lambda: ss.run(ss.from_fn(lambda c, b: jnp.maximum(c, b.max(0)), jnp.zeros(3)), X, checkpoint=ckdir),
         ["from_fn", "not additive", "Combiner"]),
        ("an accumulator that cannot fit", lambda: ss.run(ss.Histogram(bins=10**9, range=(0, 1)), X, checkpoint=ckdir),
         ["GiB", "accumulator", "more than the", "fewer bins or columns"]),
        ("rows of no values", lambda: ss.run(ss.Gram(), X[:, :0], checkpoint=ckdir), ["no values", "float32[0]"]),
        ("coordinator address without a port", lambda: distributed.initialize("localhost", 2, 0),
         ["host:port", "'localhost'"]),
        ("process id out of range", lambda: distributed.initialize("localhost:1234", 2, 5), ["process_id", "5"]),
    ]


API_IDS = [c[0] for c in api_cases("")]


@pytest.fixture(scope="module")
def api_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("api")
    (base / "a_file").write_text("")
    ss.run(ss.Gram(), X, microbatch=4, checkpoint=str(base / "ck"))
    return str(base / "ck"), str(base / "a_file")


@pytest.mark.parametrize("case", range(len(API_IDS)), ids=API_IDS)
def test_api_mistake_is_one_line_usage_error_and_touches_nothing(api_checkpoint, case):
    ckdir, blocker = api_checkpoint
    name, call, words = api_cases(ckdir, blocker)[case]
    before = snapshot(ckdir)
    try:
        call()
    except ss.UsageError as e:
        print(f"\n{name} -> {e}")
    assert_usage_error(call, words)
    assert snapshot(ckdir) == before
