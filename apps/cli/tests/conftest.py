"""What the CLI tests share, so that each pays only for what it checks:

- the demo task's assets (a random tiny model and prompts), made once per test run;
- one Ray cluster for the whole run, started as on a real cluster (``ray start --head``) the
  first time a test needs it; every run joins it through ``RAY_ADDRESS``;
- ``rlhf(...)``: the ``rlhf`` command run in this process (`rlhf.cli.main.main`), its output
  captured, inside one `rlhf.cli.warm.keep_roles_warm` for the whole test run, so a run takes
  over the engines and learner ranks the previous run of the same options left (a two-step
  run: ~0.6 s instead of ~10 s to start its processes on 2 cores);
- ``rlhf_process(...)``: the command in a process of its own, for what only a process shows
  (signals, ``kill -9``, exit codes of crashes, the environment of a run's actors), on the
  shared cluster or (``cluster="own"``) a local one of its own.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

REWARD = '''
def reward_func(queries, prompts, labels, **kwargs):
    """Graded: the fraction of label characters at the right place (varies even for a random
    policy, so group-filtering presets keep some groups)."""
    out = []
    for response, label in zip(kwargs["responses"], labels):
        out.append(sum(a == b for a, b in zip(response, label)) / len(label))
    return out
'''


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, pathlib.Path]:
    from rlhf.cli.demo import make_assets

    root = tmp_path_factory.mktemp("demo-assets")
    made = make_assets(root, noise=0.6, seed=0)
    reward = root / "graded_reward.py"
    reward.write_text(REWARD)
    return {**made, "reward": reward}


class SharedCluster:
    """The test run's Ray cluster: ``ray start --head --block`` in a session of its own
    (stopped with its process group at the end), on a loopback port. It announces 64 CPUs:
    Ray's CPUs only schedule, and runs kept warm (`rlhf.cli.warm`) hold theirs between
    tests."""

    CPUS = 64

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.failed = ""  # why it did not start: every later test fails at once with it
        self.log = pathlib.Path(tempfile.gettempdir()) / f"rlhf-tests-ray-head-{os.getpid()}.log"

    def start(self) -> str:
        from rlhf.weights.ports import free_port

        port = free_port()
        ray_cli = pathlib.Path(sys.executable).parent / "ray"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(ray_cli), "start", "--head", "--block", "--port", str(port),
                 "--num-cpus", str(self.CPUS), "--include-dashboard", "false",
                 # Not Ray's fixed default (52365): a cluster a test starts beside this one
                 # (tests/test_cluster.py's, with `ray job submit`) needs it for its job agent.
                 "--dashboard-agent-listen-port", str(free_port()),
                 "--disable-usage-stats"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                # A loopback test cluster: no token (Ray's `ray start` asks for one by default).
                env={**os.environ, "RAY_AUTH_MODE": "disabled"},
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while not _answers(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.failed = f"the tests' Ray head did not start:\n{self.log.read_text()}"
                pytest.fail(self.failed, pytrace=False)
            time.sleep(0.2)
        self.address = f"127.0.0.1:{port}"
        return self.address

    def check_alive(self) -> None:
        """Fail the calling test at once, naming the log, when the cluster is gone (the
        tests that follow then fail the same way instead of waiting on it)."""
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(
                f"the tests' shared Ray cluster ({self.address}) died with exit code "
                f"{self.proc.returncode}; its log: {self.log}, Ray's own logs under "
                f"{tempfile.gettempdir()}/ray/session_latest/logs",
                pytrace=False,
            )

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()  # `ray start --block` stops Ray's processes on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        self.proc = None
        # `ray start` names its cluster in this file, where a later plain ray.init() (another
        # test run's local cluster) would look for one to join: it goes with the cluster.
        current = pathlib.Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        port = self.address.rpartition(":")[2]
        with contextlib.suppress(OSError):
            if current.read_text().strip().endswith(f":{port}"):
                current.unlink()
        if os.environ.get("RAY_ADDRESS") == self.address:
            del os.environ["RAY_ADDRESS"]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


_cluster = SharedCluster()
_warm: list[contextlib.ExitStack] = []


def shared_cluster() -> str:
    """The shared cluster's address (started on first use); fails the test if it died."""
    if _cluster.failed:
        pytest.fail(_cluster.failed, pytrace=False)
    if _cluster.proc is None:
        os.environ["RAY_ADDRESS"] = _cluster.start()
    _cluster.check_alive()
    return _cluster.address


def connect_shared() -> None:
    """This process joins the shared cluster (once; it stays connected: the roles kept warm
    between in-process runs are its actors)."""
    import ray

    address = shared_cluster()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)


def pytest_sessionfinish(session, exitstatus) -> None:
    for stack in _warm:
        stack.close()  # the parked roles stop
    _warm.clear()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    _cluster.stop()


def _warm_roles() -> None:
    if not _warm:
        from rlhf.cli.warm import keep_roles_warm

        stack = contextlib.ExitStack()
        stack.enter_context(keep_roles_warm())
        _warm.append(stack)


def rlhf(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``rlhf <args>`` in this process, on the shared cluster, with the roles of earlier runs
    kept warm; its output and exit code as a finished process would give them (an error that
    escapes the command: its traceback on stderr and exit code 1, as Python's own). ``env``
    is set in this process while the command runs: it reaches the driver only (a run's
    actors may have started before it; use `rlhf_process` for what they must see)."""
    shared_cluster()
    _warm_roles()
    return run_here(*args, env=env)


def run_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`rlhf.cli.main.main` with ``args`` in this process, as `rlhf` runs it, without
    entering the test run's warm roles."""
    from rlhf.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argument parsing (tyro) exits
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["rlhf", *args], code, out.getvalue(), err.getvalue())


def rlhf_process(
    *args: str, timeout: float = 900, env: dict[str, str] | None = None, cluster: str = "shared"
) -> subprocess.CompletedProcess:
    """``python -m rlhf.cli <args>`` in a process of its own, on the shared cluster or
    (``cluster="own"``) a local Ray cluster it starts itself."""
    base = dict(os.environ)
    if cluster == "own":
        base.pop("RAY_ADDRESS", None)
    else:
        base["RAY_ADDRESS"] = shared_cluster()
    full = {**base, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlhf.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        check=False,
    )


def process_env(*, cluster: str = "own", **extra: str) -> dict[str, str]:
    """The environment of a test's own ``rlhf`` process (`subprocess.Popen`): this one's,
    unbuffered, joining the shared cluster or (``own``) starting a local one."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if cluster == "own":
        env.pop("RAY_ADDRESS", None)
    else:
        env["RAY_ADDRESS"] = shared_cluster()
    return env


@pytest.fixture
def ray_connected() -> None:
    """This process connected to the shared cluster (for tests that start actors here);
    never disconnected by the test."""
    connect_shared()


def small_run(
    assets: dict[str, pathlib.Path],
    *,
    steps: int = 2,
    prompts: int = 4,
    samples: int = 4,
    max_new_tokens: int = 6,
    reward: bool = True,
) -> list[str]:
    """Flags of a small ``rlhf train`` run on the demo assets: the graded reward file (unless
    ``reward`` is False), short samples, no evaluation, half a CPU per engine and actor rank."""
    return [
        "--actor.model.path", str(assets["model"]),
        "--data.prompt_data", str(assets["train"]),
        *(["--train.reward_func", str(assets["reward"])] if reward else []),
        "--train.num_steps", str(steps),
        "--rollout.batch_size", str(prompts),
        "--rollout.n_samples_per_prompt", str(samples),
        "--rollout.max_new_tokens", str(max_new_tokens),
        "--rollout.max_len", "16",
        "--eval.steps", "0",
        "--vllm.num_cpus", "0.5",
        "--actor.num_cpus_per_rank", "0.5",
    ]  # fmt: skip
