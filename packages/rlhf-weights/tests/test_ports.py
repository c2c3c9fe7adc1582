"""`rlhf.weights.ports`: rendezvous ports for process-group stores (the gloo weight broadcast's,
the learner ranks')."""


def test_rendezvous_ports_are_drawn_below_the_ephemeral_range_and_never_twice(
    tmp_path, monkeypatch
) -> None:
    """`free_port`: a port a store can bind, below the kernel's ephemeral range (where no
    outgoing connection or bind to port 0 takes it before the store listens), never the same
    one twice in a process, and the kernel's choice when that range leaves no room below."""
    import socket

    from rlhf.weights import ports

    high = ports.ephemeral_low()
    drawn = [ports.free_port() for _ in range(20)]
    assert len(set(drawn)) == 20
    assert all(ports.RENDEZVOUS_LOW <= p < high for p in drawn)
    for port in drawn[:3]:
        with socket.socket() as s:
            s.bind(("", port))  # free indeed
    fallback = ports.free_port(ephemeral_from=ports.RENDEZVOUS_LOW)
    assert fallback not in drawn and fallback >= high  # the kernel's, from its range
    # A port in use is passed over for the next draw.
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]

        class Draws:
            def __init__(self, values: list[int]) -> None:
                self.values = values

            def randrange(self, low: int, high: int) -> int:
                return self.values.pop(0)

        free = next(
            p
            for p in range(ports.RENDEZVOUS_LOW, high)
            if p not in ports._handed and ports._bindable(p)
        )
        monkeypatch.setattr(ports, "_draw", Draws([taken, drawn[0], free]))
        assert ports.free_port(ephemeral_from=65536) == free
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ports.ephemeral_low(tmp_path / "range") == 40000
    (tmp_path / "range").write_text("garbage")
    assert ports.ephemeral_low(tmp_path / "range") == 32768
    assert ports.ephemeral_low(tmp_path / "missing") == 32768
