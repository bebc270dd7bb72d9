"""Free ports come from outside the kernel's ephemeral range, so no outgoing connection can take
one between its pick and the bind of the process it is meant for."""

from __future__ import annotations

import socket

import pytest

from tandem.common import ports
from tandem.common.ports import (
    LINUX_EPHEMERAL_RANGE,
    LOWEST_PORT,
    bound_free_port,
    ephemeral_range,
    free_port,
    service_port_ranges,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768\t60999\n", (32768, 60999)),
        ("1024 65535", (1024, 65535)),
        ("", LINUX_EPHEMERAL_RANGE),
        ("40000 30000", LINUX_EPHEMERAL_RANGE),
        ("a b", LINUX_EPHEMERAL_RANGE),
    ],
)
def test_ephemeral_range_parses_the_sysctl(text: str, expected: tuple[int, int]) -> None:
    assert ephemeral_range(text) == expected


def test_service_ports_lie_on_both_sides_of_the_ephemeral_range() -> None:
    assert service_port_ranges((32768, 60999)) == [range(LOWEST_PORT, 32768), range(61000, 65536)]
    assert service_port_ranges((1024, 65535)) == []
    assert service_port_ranges((5000, 20000)) == [range(20001, 65536)]


def test_free_ports_are_outside_the_ephemeral_range_of_this_machine() -> None:
    first, last = ephemeral_range()
    if not service_port_ranges((first, last)):
        pytest.skip(f"the ephemeral range {first}-{last} leaves no other port")
    ports = [free_port() for _ in range(50)]
    assert all(LOWEST_PORT <= p < 65536 and not first <= p <= last for p in ports), ports


def test_a_bound_free_port_is_held_until_closed() -> None:
    held = bound_free_port()
    port = held.getsockname()[1]
    with socket.socket() as rival, pytest.raises(OSError, match="in use"):
        rival.bind(("127.0.0.1", port))
    held.close()
    with socket.socket() as rival:
        rival.bind(("127.0.0.1", port))


def test_a_port_is_handed_out_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes planned before either binds would otherwise be given the same port when the
    random pick repeats: here it repeats every time, and the second call gets the OS's pick."""
    first = free_port()
    monkeypatch.setattr(ports.random, "choice", lambda _: first)
    second = free_port()
    assert second != first
    with bound_free_port() as held:
        assert held.getsockname()[1] not in (first, second)
