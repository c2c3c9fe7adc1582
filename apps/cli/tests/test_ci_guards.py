"""What keeps a broken test run from holding CI: a test that hangs fails at its timeout, and
its report carries the stacks of the Ray actors it waits on (the root conftest.py), here a
learner rank stuck in a call that never returns, as a rank stuck in a collective its peer left
would be; a shared Ray cluster that died fails every later test at once, naming its log."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from .conftest import SharedCluster, shared_cluster

ROOT = pathlib.Path(__file__).resolve().parents[3]

HANGS = """
import sys
import time

import pytest
import ray.cloudpickle as cloudpickle  # what Ray pickles a call's arguments with

from rlhf.learner import LearnerGroup

# The rank cannot import this file: its function travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def wait_for_a_peer_that_left(backend):
    time.sleep(3600)


@pytest.mark.timeout(3)
def test_a_loop_that_never_ends():
    while True:
        time.sleep(0.05)


def test_after_the_loop():
    assert True


@pytest.mark.timeout(20)
def test_a_rank_that_never_answers(ray_on):
    group = LearnerGroup(num_ranks=1, num_cpus_per_rank=0.5)
    group.num_threads()  # the rank is up
    group.run(wait_for_a_peer_that_left)


def test_after_the_rank():
    assert True
"""

FIXTURE = """
import pytest
import ray


@pytest.fixture
def ray_on():
    ray.init(log_to_driver=False)  # RAY_ADDRESS: the outer test run's cluster
    yield
    ray.shutdown()
"""


def test_hanging_tests_fail_at_their_timeout_naming_themselves_with_every_stack(
    tmp_path,
) -> None:
    """A test stuck in Python fails and the run goes on; one stuck in ``ray.get`` on a rank
    that never answers stops the run (SIGINT: nothing else reaches a thread blocked there),
    which still reports what ran. Both name themselves and print the stacks, the rank's
    own included."""
    tests = tmp_path / "hangs"
    tests.mkdir()
    (tests / "test_hangs.py").write_text(HANGS)
    (tests / "conftest.py").write_text(FIXTURE)
    report = tmp_path / "junit.xml"
    # The project's pytest settings and its root conftest.py (which the test's own folder,
    # outside the tree, would not find), and short timeouts.
    out = subprocess.run(
        [sys.executable, "-m", "pytest", str(tests), "-p", "no:cacheprovider", "-p", "conftest",
         "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "-o", "timeout=600",
         f"--junitxml={report}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": shared_cluster()},
        # Started as a shell starts a background job (`nohup … &`): SIGINT ignored, which
        # the watchdog's SIGINT step must undo.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    text = out.stdout + out.stderr
    # What the watchdog said, first: the stacks that follow can run to thousands of lines.
    said = "\n".join(line for line in text.splitlines() if line.startswith("+++ "))
    assert out.returncode == 2, f"exit {out.returncode}\n{said}\n{text[-6000:]}"  # interrupted
    assert "test_hangs.py::test_a_loop_that_never_ends: over its 3 s timeout" in text, text[-6000:]
    assert "Timeout (>3.0s) from pytest-timeout" in text
    line = HANGS.splitlines().index("        time.sleep(0.05)") + 1
    assert f"line {line} in test_a_loop_that_never_ends" in text  # faulthandler, main thread
    assert "test_hangs.py::test_a_rank_that_never_answers: over its 20 s timeout" in text, said
    assert "the main thread is blocked in C (a ray.get?): stopping the test run" in text
    # The rank's own stack, written by its SIGUSR1 handler into its Ray log.
    assert "in wait_for_a_peer_that_left" in text, f"{said}\n{text[-6000:]}"
    cases = {c.get("name"): c for c in ET.parse(report).getroot().iter("testcase")}
    assert cases["test_a_loop_that_never_ends"].find("failure") is not None
    assert cases["test_after_the_loop"].find("failure") is None  # the run went on
    assert "test_after_the_rank" not in cases  # stopped


def test_a_shared_cluster_that_died_fails_the_tests_naming_its_log() -> None:
    cluster = SharedCluster()
    cluster.start()
    try:
        cluster.check_alive()  # alive: nothing happens
        os.killpg(cluster.proc.pid, signal.SIGKILL)  # the head and its processes
        cluster.proc.wait(timeout=60)
        with pytest.raises(pytest.fail.Exception) as failed:
            cluster.check_alive()
        message = str(failed.value)
        assert f"the tests' shared Ray cluster ({cluster.address}) died" in message
        assert str(cluster.log) in message
    finally:
        cluster.stop()
    assert os.environ.get("RAY_ADDRESS") != cluster.address  # the test run's own is untouched
