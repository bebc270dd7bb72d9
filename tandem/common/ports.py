"""Free TCP ports on the loopback interface, for local processes and the suites that start them.

Ports are drawn outside the kernel's ephemeral range (`net.ipv4.ip_local_port_range`). A port from
that range is also what the kernel gives every outgoing connection, so one picked now can be taken
before the process it is meant for binds it: a vLLM engine binds its KV-event and NIXL ports tens
of seconds after it is planned, while the engines beside it open connections by the hundred. A
port outside the range is only ever taken by an explicit bind. No port is handed out twice in one
process: the suites plan several processes' ports before any of them binds, so two random picks
could otherwise name the same port for two of them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_RANGE = (32768, 60999)
LOWEST_PORT = 10000
_ATTEMPTS = 200
_handed_out: set[int] = set()  # every port this process was given (at most a few thousand)


def ephemeral_range(text: str | None = None) -> tuple[int, int]:
    """(first, last) port the kernel hands to outgoing connections; Linux's default when unknown."""
    if text is None:
        try:
            text = EPHEMERAL_RANGE_FILE.read_text()
        except OSError:
            return LINUX_EPHEMERAL_RANGE
    fields = text.split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        return LINUX_EPHEMERAL_RANGE
    first, last = int(fields[0]), int(fields[1])
    return (first, last) if first <= last else LINUX_EPHEMERAL_RANGE


def service_port_ranges(ephemeral: tuple[int, int]) -> list[range]:
    """The ports outside `ephemeral` (and above the registered ones below LOWEST_PORT) to pick
    from; an empty list when the ephemeral range leaves none."""
    first, last = ephemeral
    below = range(LOWEST_PORT, max(first, LOWEST_PORT))
    above = range(max(last + 1, LOWEST_PORT), 65536)
    return [r for r in (below, above) if len(r)]


def bound_free_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port of `host` outside the ephemeral range and never handed out
    before in this process, still held: the port is the caller's until it closes the socket.
    Falls back to a port the OS picks when no random candidate binds (a machine whose ephemeral
    range covers every port, or a crowded one)."""
    ranges = service_port_ranges(ephemeral_range())
    weights = [len(r) for r in ranges]
    for _ in range(_ATTEMPTS if ranges else 0):
        port = random.choice(random.choices(ranges, weights)[0])
        if port in _handed_out:
            continue
        sock = socket.socket()
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        _handed_out.add(port)
        return sock
    sock = socket.socket()
    sock.bind((host, 0))
    _handed_out.add(int(sock.getsockname()[1]))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to at `host` right now, outside the ephemeral range (only another
    explicit bind can take it before the caller's)."""
    with bound_free_port(host) as sock:
        return int(sock.getsockname()[1])
