"""The processes of one job agree on it before any compute: a difference is one line on every process."""

import numpy as np
import pytest

from launch.processes import commands, free_port
from sharded_scan import distributed
from sharded_scan.errors import UsageError
from sharded_scan.identity import processes_difference
from tests import cli, forks, multiprocess

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

ARGS = ("--config=configs/gram.py:quick", "--config.data.num_rows=3000", "--heartbeat_timeout=10")


def test_the_difference_names_the_first_field_and_who_holds_each_value():
    same = {"data": {"path": "/a.npy", "num_rows": 10}, "microbatch": 64}
    assert processes_difference([same, same, same]) is None
    other = {"data": {"path": "/b.npy", "num_rows": 10}, "microbatch": 32}
    assert processes_difference([same, other, same]) == (
        "data.path differs (processes 0, 2: '/a.npy', process 1: '/b.npy'; 1 more field differs)")
    assert processes_difference([same, {"data": {"path": "/a.npy"}, "microbatch": 64}]) == (
        "data.num_rows differs (process 0: 10, process 1: '<absent>')")
    long = processes_difference([{"x": "a" * 500}, {"x": "b"}])
    assert len(long) < 200 and long.startswith("x differs (process 0: 'aaa") and "..." in long


def test_agree_raises_on_every_process_with_the_gathered_terms(monkeypatch):
    mine = {"data": {"seed": 0}, "steps": 4}
    distributed.agree(mine, "the job", "fix it")  # one process: nothing to compare
    gathered = []

    def peer_sends(theirs, stop=False):
        def gather(value):  # process 0 of 2: the peer sends its digest and stop flag, then its terms
            gathered.append(value)
            return [value, [distributed.json_digest(theirs), stop] if isinstance(value, list) else theirs]
        return gather

    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "gather_json", peer_sends({"data": {"seed": 7}, "steps": 4}))
    with pytest.raises(UsageError, match=r"^processes disagree on the job: data\.seed differs \(process 0: 0, "
                                         r"process 1: 7\); fix it\.$"):
        distributed.agree(mine, "the job", "fix it")
    assert gathered == [[distributed.json_digest(mine), False], mine]  # the terms only after the digests differed
    gathered.clear()
    monkeypatch.setattr(distributed, "gather_json", peer_sends(mine))
    distributed.agree(mine, "the job", "fix it")
    assert gathered == [[distributed.json_digest(mine), False]]  # agreeing costs one gather of a digest
    monkeypatch.setattr(distributed, "gather_json", peer_sends(mine, stop=True))
    with pytest.raises(distributed.Terminated):  # the peer caught a SIGTERM before the first step: both stop
        distributed.agree(mine, "the job", "fix it")


DIFFERENT_FLAGS = [
    ("--config.data.seed=7", "data.seed", ("0", "7")),  # both used to exit 0 with a mix of two datasets
    ("--config.microbatch=8", "microbatch", ("16", "8")),  # used to wait for --step_timeout
    ("--config.data.num_rows=3001", "data.num_rows", ("3000", "3001")),  # used to end in a gloo C++ abort
    ("--workdir=OTHER", "workdir", None),  # used to end in "permission denied" (one lease, two directories)
]
# The one difference given to two launcher processes (the command line: status 2 and one line on both); the
# config fields go to one pair of processes that runs the launcher's job (run_job, its command-line wording)
# with each of them in turn (two processes of ~1.8 s of imports for three differences instead of six).
ON_THE_COMMAND_LINE = "--workdir=OTHER"
FAILING = [1, 0]  # 0: the coordinator, whose store the other reads the news from


def disagreeing_jobs(workdirs: dict[str, str]):
    """In each of two processes: the library's run with other micro-batches, then with the same; then the
    launcher's job (:func:`launch.main.run_job` in :func:`launch.main.cli_wording`) with each config flag of
    ``workdirs`` given to process 1 only. Returns ``(library's lines, {flag: the launcher's line})``."""
    import jax

    from configs import gram
    from launch.config_args import literal
    from launch.main import cli_wording, run_job

    library = [library_worker(microbatch) for microbatch in ((8, 16), (8, 8))]
    lines = {}
    for flag, workdir in workdirs.items():
        config = gram.get_config("quick")
        config.data.num_rows = 3000
        if jax.process_index() == 1:
            name, value = flag.removeprefix("--config.").split("=")
            config.update_from_flattened_dict({name: literal(value)})
        try:
            with cli_wording():
                run_job(config, workdir)
        except UsageError as e:
            lines[flag] = f"error: {e}"
    return library, lines


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every two-process job of this module, the jobs side by side (most of their time is waiting for
    each other): ``{case: (ends, workdir, other workdir)}``; ends are completed processes, or for the
    config flags each process's line from :func:`disagreeing_jobs`; ``"library"``: each process's library lines."""
    cases, in_workers = {}, {}
    for i, (flag, _, _) in enumerate(DIFFERENT_FLAGS):
        base = tmp_path_factory.mktemp(f"flag{i}")
        if flag != ON_THE_COMMAND_LINE:
            in_workers[flag] = base / "w"
            continue
        cmds = commands([*ARGS, f"--workdir={base / 'w'}"], 2, 1, free_port())
        cmds[1].append(flag.replace("OTHER", str(base / "other")))  # process 1 given something else
        cases[flag] = (cmds, base / "w", base / "other")
    for failing in FAILING:
        base = tmp_path_factory.mktemp(f"failing{failing}")
        cmds = commands([*ARGS, f"--workdir={base / 'w'}"], 2, 1, free_port())
        cmds[failing].append("--config.combiner.kwargs.bogus=1")  # its error comes before the processes agree
        cases[failing] = (cmds, base / "w", None)
    with multiprocess.running("tests.test_job_agreement:disagreeing_jobs", 2, 1,
                              kwargs={"workdirs": {flag: str(w) for flag, w in in_workers.items()}}) as workers, \
            cli.concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        ends = pool.map(lambda case: cli.run_all(case[0], at_once=2), cases.values())
        found = {name: (end, *case[1:]) for (name, case), end in zip(cases.items(), ends, strict=True)}
        results = workers.results(timeout=cli.TIMEOUT)
    found["library"] = [library for library, _ in results]
    for flag, workdir in in_workers.items():
        found[flag] = ([lines[flag] for _, lines in results], workdir, None)
    return found


@pytest.mark.parametrize("flag, field, values", DIFFERENT_FLAGS)
def test_processes_started_with_different_flags_stop_in_one_line(jobs, flag, field, values):
    ends, workdir, other = jobs[flag]
    if flag == ON_THE_COMMAND_LINE:
        ends = [cli.one_error_line(end) for end in ends]  # status 2, one line, no traceback, on both
    lines = set(ends)
    assert len(lines) == 1, lines
    line = lines.pop()
    assert line.startswith(f"error: processes disagree on the job: {field} differs (process 0: ")
    values = values or (repr(str(workdir)), repr(str(other)))
    assert f"(process 0: {values[0]}, process 1: {values[1]}" in line, line
    assert "start every process with the same flags" in line
    assert not workdir.exists() and (other is None or not other.exists())  # before anything was written


def library_worker(microbatch: tuple[int, int]):
    import jax

    import sharded_scan as ss

    x = np.ones((100, 3), np.float32)
    try:
        ss.run(ss.Sum(), x, mesh="data:-1", microbatch=microbatch[jax.process_index()])
    except UsageError as e:
        return str(e)
    return None


def test_run_refuses_processes_that_differ_before_any_step(jobs):
    different, same = zip(*jobs["library"], strict=True)  # each process's runs: microbatch (8, 16), then (8, 8)
    assert different[0] == different[1] and different[0].startswith(
        "processes disagree on the job: microbatch differs (process 0: 8, process 1: 16"), different
    assert list(same) == [None, None]


@pytest.mark.parametrize("failing", FAILING)
def test_a_process_that_fails_alone_ends_the_others_in_one_line(jobs, failing):
    ends, _, _ = jobs[failing]
    own = cli.one_error_line(ends[failing])  # status 2, one line
    assert "takes no argument 'bogus'" in own
    other = ends[1 - failing]
    out = other.stdout + other.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    # It used to wait 30 s in gloo, then "lost a peer (... Gloo context initialization failed ...)", while the
    # failing process ended in JAX's C++ abort at its shutdown.
    assert other.returncode == 4 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert errors[0] == f"error: process {1 - failing} of 2 lost a peer: process {failing} ended (status 2): {own[7:]}"
    assert "Terminating process" not in out + ends[failing].stderr
