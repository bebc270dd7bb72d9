"""HAProxy in front of router replicas: a round-robin balancer on a free 127.0.0.1 port.

Writes a config (balance roundrobin over the given ports, bounded timeouts, health checks every
200 ms, a refused connection redispatched to another replica) and runs `haproxy -db` in the
foreground as a child process; `stop()` ends it. scripts/ensure-haproxy.sh installs the binary.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

from tandem_process import terminate

from tandem.common.ports import free_port


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    if found is None:
        raise RuntimeError("haproxy is not installed: run scripts/ensure-haproxy.sh")
    return found


def haproxy_config(
    port: int, backends: list[int], mode: Literal["tcp", "http"], timeout_s: float
) -> str:
    """One frontend on 127.0.0.1:`port`, round-robin over 127.0.0.1:`backends`.

    http mode balances every request (a keep-alive client still reaches every replica); tcp mode
    balances connections. A replica that refuses a connection is retried on the next one
    (`redispatch 1`, `retry-on`; http mode opens a server connection per request), and marked down after one
    failed check; requests it was answering fail (502, or a cut stream), which is what a client of
    a killed replica must see.
    """
    # A fresh server connection per request: a request that reaches a killed replica meets a
    # refused connection, which is always retried elsewhere, never a pooled connection that dies
    # under it after the kill.
    retry_on = (
        "    retry-on conn-failure empty-response\n    http-reuse never\n" if mode == "http" else ""
    )
    servers = "\n".join(
        f"    server r{i} 127.0.0.1:{p} check inter 200ms fall 1 rise 2"
        for i, p in enumerate(backends)
    )
    return f"""global
    maxconn 4096

defaults
    mode {mode}
    timeout connect 1s
    timeout client {timeout_s:g}s
    timeout server {timeout_s:g}s
    timeout queue 2s
    retries 3
    option redispatch 1
{retry_on}
frontend replicas
    bind 127.0.0.1:{port}
    default_backend routers

backend routers
    balance roundrobin
{servers}
"""


class HAProxy:
    """`haproxy -db -f CONFIG` as a child process, ready once its port accepts connections."""

    def __init__(
        self, backends: list[int], mode: Literal["tcp", "http"] = "http", timeout_s: float = 60.0
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-haproxy-"))
        config = self.dir / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, backends, mode, timeout_s))
        self.log = (self.dir / "haproxy.log").open("wb")
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(config)], stdout=self.log, stderr=subprocess.STDOUT
        )
        self._wait_listening(10.0)

    def _wait_listening(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.output()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"haproxy not listening after {limit_s} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return (self.dir / "haproxy.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        terminate(self.proc, 5.0)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
