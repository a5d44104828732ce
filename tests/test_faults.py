"""Kill anywhere (small): a SIGKILL at a random moment and one during a save, each rerun bitwise."""

import json
import sys

import pytest

from bench import faults
from tests import cli, forks

# bench/faults.py's job processes (its --child): forks of one process that imported the library (tests/forks.py),
# ~1.1 s of CPU of imports less each of the five; the episodes, kills and comparisons are the bench's own.
launcher_forks = forks.module_fixture()
JOB = "import sys; from bench.faults import child; child(sys.argv[1], int(sys.argv[2]))"  # what --child runs


def test_two_kills_each_rerun_bitwise_with_every_row_once(tmp_path, monkeypatch, capsys):
    def start(workdir, rows):  # bench/faults.py's start(), its job forked
        cmd, env = [sys.executable, "-c", JOB, str(workdir), str(rows)], faults.env()
        assert forks.forkable(cmd, env) is not None, "a job process the fork server cannot run"
        with open(workdir / "log.txt", "a") as log:
            return forks.start(cmd, cli.ROOT, env, log)

    out = tmp_path / "faults.json"
    monkeypatch.setattr(faults, "start", start)
    monkeypatch.setattr(sys, "argv", ["bench/faults.py", "--faults=kill", "--kills=2", "--rows=20000", "--seed=0",
                                      f"--out={out}"])
    with pytest.raises(SystemExit) as end:
        faults.main()
    printed = capsys.readouterr().out
    assert end.value.code == 0, printed[-3000:]
    tally = json.loads(out.read_text())
    assert tally["kills"] == 2 and len(tally["episodes"]) == 2
    assert tally["bitwise_equal"] == 2 and tally["rows_counted_once"] == 2, tally
    assert [e["target"] for e in tally["episodes"]] == ["random", "save"]
    assert tally["episodes"][1]["during_save"], tally  # the second kill landed inside a save
    assert tally["episodes"][1]["resumed_from_cursor"] is not None  # and resumed from the one before
    assert "bitwise equal 2/2" in printed
