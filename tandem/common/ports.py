"""A free TCP port on the loopback interface, for local processes and the suites that start them."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` right now (the OS picks it; another bind may race)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
