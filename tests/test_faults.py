"""Kill anywhere (small): a SIGKILL at a random moment and one during a save, each rerun bitwise."""

import json
import subprocess
import sys

from tests import cli


def test_two_kills_each_rerun_bitwise_with_every_row_once(tmp_path):
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [sys.executable, "bench/faults.py", "--faults=kill", "--kills=2", "--rows=20000", "--seed=0", f"--out={out}"],
        cwd=cli.ROOT, env=cli.env(), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tally = json.loads(out.read_text())
    assert tally["kills"] == 2 and len(tally["episodes"]) == 2
    assert tally["bitwise_equal"] == 2 and tally["rows_counted_once"] == 2, tally
    assert [e["target"] for e in tally["episodes"]] == ["random", "save"]
    assert tally["episodes"][1]["during_save"], tally  # the second kill landed inside a save
    assert tally["episodes"][1]["resumed_from_cursor"] is not None  # and resumed from the one before
    assert "bitwise equal 2/2" in proc.stdout
