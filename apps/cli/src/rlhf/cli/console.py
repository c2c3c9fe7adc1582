"""Where a run's lines go. On a terminal one status line (a training progress bar) stays at
the bottom and is redrawn in place while the other lines scroll above it, as tqdm does; in a
log file or a pipe every status is a plain line of its own."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Callable
from typing import TextIO

_CLEAR = "\r\x1b[K"  # back to the line's start, erase it


class Console:
    """The run's echo: call it with a line; `status` for the line that is redrawn in place.

    Args:
        stream: Where the lines go (default stdout).
        live: Redraw status lines in place; default: when ``stream`` is a terminal (not
            ``TERM=dumb``).
    """

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
        self.live = live
        self._shown = ""  # the status line on screen
        self._lock = threading.Lock()  # the driver's threads (saves, evaluation) echo too

    def __call__(self, line: str) -> None:
        with self._lock:
            if self._shown:  # the line goes above the status line, which is drawn again
                self.stream.write(f"{_CLEAR}{line}\n{self._shown}")
            else:
                self.stream.write(f"{line}\n")
            self.stream.flush()

    def status(self, line: str) -> None:
        """Show ``line`` as the status: in place on a terminal (cut to its width, so that it
        never wraps), else as a plain line."""
        if not self.live:
            self(line)
            return
        text = line[: max(shutil.get_terminal_size().columns - 1, 20)]
        with self._lock:
            self.stream.write(f"{_CLEAR}{text}")
            self.stream.flush()
            self._shown = text

    def close(self) -> None:
        """End the status line (the next output starts on a line of its own)."""
        with self._lock:
            if self._shown:
                self.stream.write("\n")
                self.stream.flush()
                self._shown = ""


def live_console(echo: Callable[[str], None]) -> Console | None:
    """``echo`` when it is a console that redraws its status line in place, else None (a
    plain callable, or a console writing to a log)."""
    return echo if isinstance(echo, Console) and echo.live else None


def bar(done: int, total: int, *, width: int = 20) -> str:
    """``done`` of ``total`` as a bar of ``width`` cells: ``#`` done, ``.`` to go."""
    filled = min(width, done * width // max(total, 1))
    return "#" * filled + "." * (width - filled)
