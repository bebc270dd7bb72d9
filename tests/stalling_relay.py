"""A TCP relay in front of an engine whose listener can stall: while stalled it accepts nothing and
its accept queue is full, so the kernel drops a new connection's SYN and the connect times out, as
for an engine (or a machine) too busy to accept; connections already open go on."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from urllib.parse import urlsplit

from tandem.common.ports import free_port


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class StallingRelay:
    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.listener = socket.create_server(("127.0.0.1", self.port), backlog=0)
        self.accepting = threading.Event()
        self.accepting.set()
        self.stopped = threading.Event()
        self.fillers: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept_loop, daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            if not self.accepting.wait(0.05):
                continue
            readable, _, _ = select.select([self.listener], [], [], 0.05)
            if readable and self.accepting.is_set():
                client, _ = self.listener.accept()
                threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        back.start()
        _pipe(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def stall(self) -> None:
        """Stop accepting and fill the accept queue (the kernel keeps backlog + 1 connections; the
        rest of the fillers wait in SYN-SENT)."""
        self.accepting.clear()
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            self.fillers.append(filler)

    def resume(self) -> None:
        """Accept again: the fillers, closed, are accepted and end at once; a SYN the kernel
        retransmits from then on gets through."""
        for filler in self.fillers:
            filler.close()
        self.fillers.clear()
        self.accepting.set()

    def stop(self) -> None:
        self.resume()
        self.stopped.set()
        self.thread.join(5)
        self.listener.close()
