"""`free_port`: the port a process group's store (torch's ``TCPStore`` on rank 0) will listen on:
the gloo weight broadcast's group here, the learner's DeepSpeed and FSDP2 ranks in
``rlhf.learner``.

The port is chosen in one process and bound seconds later in another (a rank that first imports
its backend, an engine that joins the group), so "free now" is not enough: a port of the
kernel's ephemeral range can meanwhile become an outgoing connection's source port or another
process's bind to port 0 (gloo's pairs, Ray's servers), and the store then fails with
``EADDRINUSE``. Ports are therefore drawn at random below that range (and above Ray's default
worker ports, 10002-19999), where neither happens, and never handed out twice by one process.
"""

from __future__ import annotations

import pathlib
import random
import socket

RENDEZVOUS_LOW = 20000
"""The lowest port drawn (Ray's workers listen on 10002-19999 unless told otherwise)."""

_EPHEMERAL = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed: set[int] = set()
_draw = random.SystemRandom()


def ephemeral_low(path: pathlib.Path = _EPHEMERAL) -> int:
    """The first port of the kernel's ephemeral range (Linux's ``ip_local_port_range``; its
    default, 32768, where that file does not exist or does not parse)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface, as the store listens
        except OSError:
            return False
    return True


def free_port(*, ephemeral_from: int | None = None, tries: int = 64) -> int:
    """A TCP port free now, drawn below the ephemeral range that starts at ``ephemeral_from``
    (None: this machine's, `ephemeral_low`) and not returned before by this process. When
    that range leaves no room below it (or ``tries`` draws all fail), the kernel's choice."""
    high = ephemeral_low() if ephemeral_from is None else ephemeral_from
    if high > RENDEZVOUS_LOW:
        for _ in range(tries):
            port = _draw.randrange(RENDEZVOUS_LOW, high)
            if port not in _handed and _bindable(port):
                _handed.add(port)
                return port
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port not in _handed:
            _handed.add(port)
            return port
