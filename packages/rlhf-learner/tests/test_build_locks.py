"""A DeepSpeed start-up that waits on a stale compiled-op build lock names the file."""

import os
import pathlib
import subprocess
import sys
import threading


def test_a_wait_on_a_stale_build_lock_names_the_lock_file(tmp_path: pathlib.Path) -> None:
    # A lock left by a compile that was killed: torch's loader waits for it to disappear.
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path), RLHF_BUILD_LOCK_NOTICE_S="1")
    code = "from rlhf.learner.deepspeed_backend import init_distributed; init_distributed()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    seen: list[str] = []
    give_up = threading.Timer(90, proc.kill)  # no notice: the wait is silent, the test fails
    give_up.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "delete the file" in line:
                break
    finally:
        give_up.cancel()
        proc.kill()
        proc.wait()
    text = "".join(seen)
    assert "still waiting for a compiled-op build lock" in text, text[-3000:]
    assert f"  {lock}\n" in text and "delete the file" in text, text[-3000:]
