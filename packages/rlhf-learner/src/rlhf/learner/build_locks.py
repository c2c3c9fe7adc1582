"""A wait on a compiled-op build lock that nobody holds any more, named instead of silent.

DeepSpeed compiles some ops on first use through torch's C++ extension loader (on CPU the
shared-memory collective op, during ``deepspeed.init_distributed``). The loader takes a lock
file in the op's build directory and every other process waits for that file to disappear; a
process killed while compiling leaves it behind, and every later run then waits forever
without a word. `naming_build_locks` prints the lock files that exist once a wait has lasted
``after_s`` seconds, with what to do about them (the DeepSpeed backend waits 120 s, or
``RLHF_BUILD_LOCK_NOTICE_S``, before it looks).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import threading
from collections.abc import Iterator


def build_lock_files() -> list[pathlib.Path]:
    """The lock files under torch's extension build root (``TORCH_EXTENSIONS_DIR`` or its
    default), one or two levels down: ``<root>/<op>/lock`` or ``<root>/<py_device>/<op>/lock``."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        root = pathlib.Path(env)
    else:
        from torch.utils.cpp_extension import get_default_build_root

        root = pathlib.Path(get_default_build_root())
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def _notice() -> None:
    locks = build_lock_files()
    if not locks:
        return
    listed = "\n".join(f"  {path}" for path in locks)
    print(
        "[rlhf] still waiting for a compiled-op build lock:\n"
        f"{listed}\n"
        "A process compiling the op holds it. If none is running any more (one was killed"
        " while compiling), stop this run, delete the file and start the run again.",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def naming_build_locks(*, after_s: float) -> Iterator[None]:
    """Run the body; when it is still running after ``after_s`` seconds, print the build lock
    files that exist (nothing when there are none)."""
    timer = threading.Timer(after_s, _notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
