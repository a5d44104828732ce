"""WORKSPACE.md's launch recipes, run by simulation: two local processes per recipe.

Each recipe's processes get the environment its launcher would give them (``srun``'s SLURM
variables, Open MPI's ``mpirun`` variables, a Kubernetes Indexed Job's completion index) and
run ``launch.main`` without coordinator flags where JAX detects the cluster itself; a
multi-slice mesh built with ``create_hybrid_device_mesh`` runs with processes standing in for
slices. They all run at once (eight processes, tiny data); every process ends in the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import yaml

from tests import cli, forks, multiprocess

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

NUM_PROCESSES = 2
DEVICES = 2
# No checkpoints: a recipe forms the job (saves of several processes: test_dead_peer, test_compact_checkpoint);
# each process saves nothing.
ARGS = ("--config=configs/gram.py:quick", f"--jax_num_cpu_devices={DEVICES}", "--jax_platforms=cpu",
        "--heartbeat_timeout=10", "--config.checkpoint.enabled=false")
# Variables of launchers and clusters that JAX's detection (or the recipes) read: none leaks in.
CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PRTE_", "TPU_", "MEGASCALE_", "KUBERNETES_", "JOB_COMPLETION_INDEX",
                    "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS", "JAX_PROCESS")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that nothing listens on right now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def clean_env(**extra: str) -> dict[str, str]:
    """The launcher tests' environment without any cluster's variables, plus ``extra``."""
    env = {k: v for k, v in cli.env().items() if not k.startswith(CLUSTER_PREFIXES)}
    return {**env, **extra}


def slurm_env(rank: int, port: int) -> dict[str, str]:
    """What ``srun --nodes=1 --ntasks=2`` gives task ``rank`` (one node: local id = rank)."""
    return clean_env(
        SLURM_JOB_ID="4242", SLURM_JOBID="4242", SLURM_STEP_ID="0", SLURM_STEP_NODELIST="localhost",
        SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost", SLURM_NTASKS=str(NUM_PROCESSES),
        SLURM_NPROCS=str(NUM_PROCESSES), SLURM_STEP_NUM_TASKS=str(NUM_PROCESSES), SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1",
        SLURM_TASKS_PER_NODE=str(NUM_PROCESSES), JAX_COORDINATOR_PORT=str(port),
    )


def ompi_env(rank: int, port: int) -> dict[str, str]:
    """What Open MPI 4's ``mpirun -np 2`` gives rank ``rank`` on one host."""
    return clean_env(
        OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://127.0.0.1:47123", OMPI_COMM_WORLD_SIZE=str(NUM_PROCESSES),
        OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_SIZE=str(NUM_PROCESSES), OMPI_COMM_WORLD_NODE_RANK="0",
        JAX_COORDINATOR_PORT=str(port),
    )


def indexed_job_command() -> list[str]:
    """The container command of WORKSPACE.md's Kubernetes Indexed Job."""
    text = (cli.ROOT / "WORKSPACE.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml")[1:]]
    docs = [d for b in blocks if "completionMode: Indexed" in b for d in yaml.safe_load_all(b)]
    (job,) = [d for d in docs if d and d.get("kind") == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container["command"] + container["args"]


def k8s_cmd(workdir: Path, port: int) -> list[str]:
    """The recipe's command line, pointed at this machine: for its ``python -m launch.main``, a fork of
    the module's server (tests/forks.py: this interpreter, whose packages the test runs with, not the
    first on PATH), its coordinator host mapped to 127.0.0.1, two processes, the quick config, a local
    workdir and CPU devices."""
    shell, flag, line = indexed_job_command()
    for old, new in (("python -m launch.main ", f"{shlex.quote(sys.executable)} -m tests.forks --client=launch.main "),
                     ("gram-0.gram:1234", f"127.0.0.1:{port}"), ("--num_processes=4", "--num_processes=2"),
                     ("--config=configs/gram.py ", "--config=configs/gram.py:quick "),
                     ("--workdir=/shared/gram", f"--workdir={workdir}")):
        assert old in line, f"WORKSPACE.md's Indexed Job recipe changed: no {old!r} in {line!r}"
        line = line.replace(old, new)
    return [shell, flag, f"{line} {' '.join(ARGS[1:])}"]


def quick_source():
    """The rows of ``configs/gram.py:quick`` (synthetic, the same on every process)."""
    from configs.gram import get_config
    from launch.data import make_source

    return make_source(get_config("quick").data)


def reference_gram() -> np.ndarray:
    """X^T X of the quick config's rows, in float64."""
    source = quick_source()
    x = np.asarray(source.read(0, source.num_rows), np.float64)
    return x.T @ x


def hybrid_mesh_worker() -> np.ndarray:
    """WORKSPACE.md's multi-slice mesh, each process a "slice" (``process_is_granule``): the
    quick Gram job with ``data`` across the slices and ``model`` inside each."""
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    import sharded_scan as ss

    per_slice, m = DEVICES, DEVICES
    devices = mesh_utils.create_hybrid_device_mesh((per_slice // m, m), (NUM_PROCESSES, 1), process_is_granule=True)
    mesh = Mesh(devices, ("data", "model"))
    assert [d.process_index for d in devices[:, 0]] == list(range(NUM_PROCESSES))  # data crosses the slices
    assert all(len({d.process_index for d in row}) == 1 for row in devices)  # model stays inside one
    return np.asarray(ss.run(ss.Gram(), quick_source(), mesh=mesh, microbatch=16, steps_per_call=2))


def test_slurm_ompi_indexed_job_and_hybrid_mesh_recipes_each_form_a_two_process_job(tmp_path, launcher_forks):
    ports = dict(zip(("slurm", "ompi", "k8s"), free_ports(3), strict=True))
    runs = {}  # recipe -> [(cmd, env)] of its processes
    for name, make_env in (("slurm", slurm_env), ("ompi", ompi_env)):
        cmd = [sys.executable, "-m", "launch.main", f"--workdir={tmp_path / name}", *ARGS]
        runs[name] = [(cmd, make_env(rank, ports[name])) for rank in range(NUM_PROCESSES)]
    launcher_forks.start()  # the Indexed Job's shell asks it for its process
    runs["k8s"] = [(k8s_cmd(tmp_path / "k8s", ports["k8s"]),
                    clean_env(JOB_COMPLETION_INDEX=str(i), **{forks.SOCKET_ENV: launcher_forks.path}))
                   for i in range(NUM_PROCESSES)]
    logs = {(name, i): tmp_path / f"{name}-{i}.log" for name in runs for i in range(NUM_PROCESSES)}
    with contextlib.ExitStack() as stack:
        hybrid = stack.enter_context(
            multiprocess.running("tests.test_launch_recipes:hybrid_mesh_worker", NUM_PROCESSES, DEVICES))
        procs = {}
        # SLURM's pair first, then the other two: their processes compile the same programs, which they then
        # read from the run's compilation cache (processes compiling at once each compile their own).
        for wave in (("slurm",), ("ompi", "k8s")):
            started = {}
            for name, i in (key for key in logs if key[0] in wave):
                cmd, env = runs[name][i]
                started[name, i] = stack.enter_context(cli.started(cmd, logs[name, i], env))
            multiprocess.wait_all(list(started.values()), cli.TIMEOUT)
            procs.update(started)
        codes = {key: proc.poll() for key, proc in procs.items()}
        hybrid_results = hybrid.results(cli.TIMEOUT)
    failed = {key: code for key, code in codes.items() if code != 0}
    assert not failed, "\n".join(f"--- {name} process {i}: exit {code}\n{logs[name, i].read_text()[-3000:]}"
                                 for (name, i), code in failed.items())

    want = reference_gram()
    results = {}
    for name, started_as in (("slurm", "auto:slurm"), ("ompi", "auto:ompi"), ("k8s", "explicit")):
        record = json.loads((tmp_path / name / "summary.json").read_text())
        assert (record["processes"], record["devices"], record["distributed"]) == (2, 4, started_as), name
        for i in range(NUM_PROCESSES):
            assert f"process {i} of 2 ({started_as})" in logs[name, i].read_text(), (name, i)
        results[name] = cli.result(tmp_path / name)
        np.testing.assert_allclose(results[name]["result"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
    cli.assert_same(results["slurm"], results["ompi"])  # the same job on the same 2 x 2 split: bitwise
    cli.assert_same(results["slurm"], results["k8s"])
    for i, result in enumerate(hybrid_results):
        np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"hybrid {i}")


CLEAN_CHECK = textwrap.dedent("""
    import json, os, jax
    from sharded_scan import distributed
    from sharded_scan.errors import UsageError
    out = {"auto": distributed.initialize(), "started": jax.distributed.is_initialized(),
           "preemption_service": jax.config.jax_enable_preemption_service}
    os.environ["JAX_COORDINATOR_ADDRESS"] = "127.0.0.1:1"  # half of JAX's own variables
    try:
        distributed.initialize()
    except UsageError as e:
        out["half_set"] = [str(e), jax.distributed.is_initialized()]
    del os.environ["JAX_COORDINATOR_ADDRESS"]
    jax.distributed.initialize("127.0.0.1:%d", 1, 0)  # JAX's state was left unstarted: it still starts
    out["explicit"] = [jax.distributed.is_initialized(), jax.process_count()]
    out["backend_running"] = distributed.initialize()  # too late to ask JAX; nothing names a cluster
    os.environ.update(SLURM_JOB_ID="1", SLURM_STEP_NODELIST="n1", SLURM_NTASKS="2", SLURM_PROCID="0",
                      SLURM_LOCALID="0")
    try:
        distributed.initialize()
    except UsageError as e:
        out["late_in_slurm"] = str(e)
    jax.distributed.shutdown()
    print(json.dumps(out))
""")


def test_no_cluster_is_one_process_and_leaves_jax_distributed_unstarted():
    # Pins what JAX must keep doing: with no cluster, jax.distributed.initialize() raises its
    # "coordinator_address should be defined." ValueError before changing any state.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), "PYTHONPATH": str(cli.ROOT),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CLEAN_CHECK % free_ports(1)[0]], cwd=cli.ROOT, env=env,
                          capture_output=True, text=True, timeout=cli.TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert (out["auto"], out["started"], out["preemption_service"]) == ("single", False, True)
    assert out["explicit"] == [True, 1]
    assert "JAX_NUM_PROCESSES" in out["half_set"][0] and not out["half_set"][1]  # one line, still unstarted
    assert out["backend_running"] == "single"
    assert "slurm" in out["late_in_slurm"] and "before anything touches JAX" in out["late_in_slurm"]
