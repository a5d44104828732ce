"""README.md and WORKSPACE.md run as pasted: every ``bash``/``python`` code block is run, in order,
in a fresh directory standing in for ``/tmp`` (so a workdir two examples share would show), except
blocks marked ``<!-- docs-test: skip: REASON -->`` (TPU pods, clusters, placeholders, minutes-long
runs), which must say why.

What a fresh virtual environment would add is checked against ``setup.cfg``: each block's imports
are installed by the install line it names (``pip install -e ".[tabular]"`` in the block, else the
base install), so a block that needs pandas says an extra that brings it. The blocks run in this
environment, with ``sharded-scan`` / ``sharded-scan-local`` standing for ``python -m launch.main`` /
``launch.local`` from this checkout; those command lines (either spelling) run as forks of one process that
imported what they import (tests/forks.py: the same run, ~1.1 s of CPU less each; ``python -m launch.main``
itself starts in tests/test_cli_config.py; launch.local's own processes are fresh interpreters). Blocks that name
the same ``/tmp`` path run in order in one chain (consecutive python blocks of a chain in one process, each with
its own names: a name one block leaves to another is an error), and the chains side by side, to stay within a
minute. The python blocks that leave JAX's settings as they find them (no ``jax.config``) and come first in their
chains (python-only chains, the block writing the files a chain's commands read) run one after another
in one process, each chain's other blocks after it: an interpreter and JAX's imports (~1.7 s of CPU)
in all, not one per example.
"""

from __future__ import annotations

import concurrent.futures
import configparser
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli, forks

DOCS = ("README.md", "WORKSPACE.md")
FENCE = re.compile(r"^(?:<!-- docs-test: (?P<mark>.*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```[ \t]*$",
                   re.M | re.S)
RUNNABLE = ("bash", "python")
INSTALL = re.compile(r"""pip install (?:-e )?["']?(?:\.|sharded_scan)(?:\[(?P<extras>[\w,-]+)\])?["']?""")
IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.M)
OWN = ("sharded_scan", "launch", "configs", "bench", "tests")
MODULE_DIST = {"sklearn": "scikit-learn", "jaxlib": "jaxlib"}  # import name -> distribution, where they differ
TIMEOUT = 600
LAUNCHER = re.compile(r"\bpython -m (launch\.main|launch\.local)\b")
SHIMS = {"launch.main": "sharded-scan", "launch.local": "sharded-scan-local"}
# python blocks of one group run in one process, each in a namespace of its own
RUNNER = """
import sys, traceback
for path in sys.argv[1:]:
    name = path.rsplit('/', 1)[-1]
    with open(path) as f:
        code = compile(f.read(), name, 'exec')
    print(f'--- {name}', flush=True)
    exec(code, {'__name__': '__main__'})
"""


@dataclasses.dataclass
class Block:
    doc: str
    line: int
    lang: str
    body: str
    mark: str | None

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    text = (cli.ROOT / doc).read_text()
    return [Block(doc, text.count("\n", 0, m.start("lang")) + 1, m.group("lang"), m.group("body"), m.group("mark"))
            for m in FENCE.finditer(text)]


def runnable(doc: str) -> list[Block]:
    return [b for b in blocks(doc) if b.lang in RUNNABLE and b.mark is None]


def requirements() -> tuple[set[str], dict[str, set[str]]]:
    """setup.cfg's base requirements and extras, as distribution names."""
    cfg = configparser.ConfigParser()
    cfg.read(cli.ROOT / "setup.cfg")

    def names(text: str) -> set[str]:
        return {re.split(r"[\s<>=!~\[;]", line.strip(), maxsplit=1)[0].lower() for line in text.splitlines()
                if line.strip()}

    extras = {name: names(text) for name, text in cfg["options.extras_require"].items()}
    return names(cfg["options"]["install_requires"]), extras


def installed_by(block: Block) -> set[str]:
    """The distributions the block's install line brings (the base install when it names none)."""
    base, extras = requirements()
    found = set(base)
    for m in INSTALL.finditer(block.body):
        for extra in filter(None, (m.group("extras") or "").split(",")):
            assert extra in extras, f"{block.name}: setup.cfg has no extra {extra!r}"
            found |= extras[extra]
    return found


def test_every_block_is_run_or_says_why_not():
    kinds = {}
    for doc in DOCS:
        for b in blocks(doc):
            assert b.lang in (*RUNNABLE, "yaml", "text", ""), f"{b.name}: a ```{b.lang} block"
            if b.mark is not None:
                assert re.fullmatch(r"skip: \S.*", b.mark), f"{b.name}: write <!-- docs-test: skip: REASON -->"
            kinds[b.name] = "skip" if b.mark else b.lang
    assert list(kinds.values()).count("python") >= 3 and list(kinds.values()).count("bash") >= 4, kinds  # found


def test_each_block_imports_only_what_its_install_line_brings():
    stdlib = set(sys.stdlib_module_names)
    for doc in DOCS:
        for b in runnable(doc):
            if b.lang != "python":
                continue
            have = installed_by(b)
            for module in set(IMPORT.findall(b.body)) - stdlib - set(OWN):
                dist = MODULE_DIST.get(module, module).lower()
                assert dist in have or module in ("jax", "numpy"), (
                    f"{b.name} imports {module}, which its install line does not bring ({sorted(have)})")
            if re.search(r"parquet|Parquet|CsvSource|to_csv", b.body):
                assert "pyarrow" in have, f"{b.name} reads Parquet/CSV: its install line must bring pyarrow"


def commands(body: str) -> list[list[str]]:
    """The shell commands of a bash block (line continuations joined, comments dropped, ``&&`` split)."""
    out: list[list[str]] = []
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        words: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word in ("&&", ";", "||"):
                out += [words] if words else []
                words = []
            else:
                words.append(word)
    return out


def test_each_example_has_its_own_workdir():
    jobs: dict[str, set[tuple[str, ...]]] = {}
    for doc in DOCS:
        for b in runnable(doc):
            if b.lang == "bash":
                for words in commands(b.body):
                    workdir = next((w.split("=", 1)[1] for w in words if w.startswith("--workdir=")), None)
                    if workdir:
                        job = tuple(sorted(w for w in words if not w.startswith(("--workdir=", "--jax_"))))
                        jobs.setdefault(workdir, set()).add(job)
            for directory in re.findall(r"""checkpoint=["']([^"']+)""", b.body):
                jobs.setdefault(directory, set()).add((b.name,))
    shared = {workdir: sorted(j) for workdir, j in jobs.items() if len(j) > 1}
    assert not shared, f"one workdir, different jobs: {shared}"
    assert len(jobs) >= 4, jobs  # not vacuous: the workdirs of README and WORKSPACE are found


def chains() -> list[list[Block]]:
    """The runnable blocks of every doc in chains that can run side by side: blocks that name the
    same ``/tmp`` path (a file one writes and the next reads, a workdir run twice) share a chain,
    in the docs' order."""
    every = [b for doc in DOCS for b in runnable(doc)]
    chain = list(range(len(every)))
    seen: dict[str, int] = {}
    for i, b in enumerate(every):
        for path in set(re.findall(r"/tmp/[\w.-]+(?:/[\w.-]+)*", b.body)):
            j = seen.setdefault(path, i)
            old, new = chain[j], chain[i]
            chain = [old if c == new else c for c in chain]
    return [[b for b, c in zip(every, chain, strict=True) if c == first] for first in dict.fromkeys(chain)]


def shareable(b: Block) -> bool:
    """A python block that sets nothing of JAX's (no ``jax.config``): it runs alike in a fresh interpreter."""
    return b.lang == "python" and "jax.config" not in b.body


def lead(chain: list[Block]) -> int:
    """How many of the chain's first blocks are shareable python blocks."""
    return next((i for i, b in enumerate(chain) if not shareable(b)), len(chain))


def processes(found: list[list[Block]]) -> list[list[Block]]:
    """The chains as they run: the shareable python blocks that lead their chains (every block of a
    python-only chain, the python that writes the files a chain's commands then read) joined into one
    process, in the docs' order, each chain's other blocks after them in the order they came."""
    led = [chain for chain in found if lead(chain)]
    if not led:
        return found
    joined = [b for chain in led for b in chain[:lead(chain)]] + [b for chain in led for b in chain[lead(chain):]]
    return [chain for chain in found if chain not in led] + [joined]


def script(chain: list[Block], tmp: Path) -> str:
    """One bash script running a chain's blocks in order (/tmp -> ``tmp``); consecutive python
    blocks in one process."""
    lines = ["set -euo pipefail"]
    group: list[str] = []

    def flush():
        if group:
            lines.append(" ".join([shlex.quote(sys.executable), shlex.quote(str(tmp / "runner.py")), *group]))
            group.clear()

    for b in chain:
        body = b.body.replace("/tmp/", f"{tmp}/")
        if b.lang == "python":
            path = tmp / f"{b.doc}:{b.line}"
            path.write_text(body)
            group.append(shlex.quote(str(path)))
            continue
        flush()
        body = LAUNCHER.sub(lambda m: SHIMS[m.group(1)], body)  # the installed commands, as the docs say: forks
        body = re.sub(INSTALL.pattern + r"\s*&&\s*", "", body)  # installed already (checked above)
        body = "\n".join(line for line in body.splitlines() if not INSTALL.match(line.strip()))
        lines += [f"echo '--- {b.name}'", body]
    flush()
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every chain run to its end, at most one a core (2 to 4) at once: ``{chain's block names: process}``."""
    tmp = tmp_path_factory.mktemp("docs")
    (tmp / "runner.py").write_text(RUNNER)
    shims = tmp / "bin"
    shims.mkdir()
    for name, module in (("sharded-scan", "launch.main"), ("sharded-scan-local", "launch.local")):
        module = f"tests.forks --client={module}"  # a fork of the server below
        (shims / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m {module} "$@"\n')
        (shims / name).chmod(0o755)
    env = cli.env()
    env["PATH"] = f"{shims}:{env['PATH']}"
    scripts = {tuple(b.name for b in chain): script(chain, tmp)
               for chain in sorted(processes(chains()), key=len, reverse=True)}

    def run(text):
        return subprocess.run(["bash", "-c", text], cwd=cli.ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)

    with forks.serving(env) as server:
        server.start()
        env[forks.SOCKET_ENV] = server.path
        with concurrent.futures.ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 2))) as pool:
            return dict(zip(scripts, pool.map(run, scripts.values()), strict=True))


def test_blocks_in_chains():
    found = chains()
    names = [[b.name for b in chain] for chain in found]
    writer = next(b.name for b in runnable("README.md") if "to_parquet(\"/tmp/ss_data/sales.parquet\"" in b.body)
    together = next(chain for chain in found if writer in [b.name for b in chain])  # writes the files the CLI reads
    assert any(b.lang == "bash" and "/tmp/ss_data/sales.parquet" in b.body for b in together), names
    assert sum(len(chain) for chain in found) == sum(len(runnable(doc)) for doc in DOCS)
    joined = processes(found)  # the python blocks leading their chains, setting nothing of JAX's, share one process
    assert sorted(b.name for chain in joined for b in chain) == sorted(b.name for chain in found for b in chain)
    shared = [chain for chain in joined if chain not in found]
    assert len(shared) == 1 and sum(b.lang == "python" for b in shared[0]) >= 3, names
    order = [b.name for b in shared[0]]
    for chain in found:  # each chain's blocks in its order, its python first (one run of python blocks: one process)
        assert [name for name in order if name in [b.name for b in chain]] in ([b.name for b in chain], []), names
    python = [b.lang == "python" for b in shared[0]]
    assert python == sorted(python, reverse=True) and all(shareable(b) for b in shared[0] if b.lang == "python")
    reader = [b for b in shared[0] if b.lang == "bash" and "/tmp/ss_data/sales.parquet" in b.body]
    assert writer in order and reader, order  # the file's writer in the shared process, its reader after it


@pytest.mark.parametrize("doc", DOCS)
def test_the_blocks_run_as_pasted(runs, doc):
    ran = []
    for names, proc in runs.items():
        if not any(name.startswith(f"{doc}:") for name in names):
            continue
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{names}: {out[-6000:]}"
        assert "Traceback" not in out and "\nerror:" not in out, f"{names}: {out[-6000:]}"
        ran += re.findall(rf"^--- ({re.escape(doc)}:\d+)", proc.stdout, re.M)
    assert sorted(ran) == sorted(b.name for b in runnable(doc)), ran
