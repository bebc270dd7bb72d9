"""`tandem router --processes N`: N router processes on one port, kept running by a supervisor.

The supervisor checks that the port is free (so it is shared only among its own workers), then
starts N `python -m tandem.cli router` workers on it with SO_REUSEPORT; the kernel spreads new
connections over them. Each worker is a whole router (processes.py says what is split) with its
admin endpoint on a private 127.0.0.1 port, which it reports on a pipe once it serves. The
supervisor restarts a worker that exits (with backoff), serves the configured admin port (probes,
/metrics merged over the workers, /engines) and on SIGTERM/SIGINT stops the workers, each draining
as a single router does. Workers ask the kernel for SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG), so a killed supervisor takes them down.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tandem.router.config import RouterConfig
from tandem.router.errors import error_body
from tandem.router.httpserver import HttpServer, Request, Responder
from tandem.router.metrics_merge import merge_families, render_families
from tandem.router.processes import merge_engine_views, restart_delay, worker_config
from tandem.router.upstream import UpstreamError, Upstreams

log = logging.getLogger("tandem.router.supervisor")

# A worker learns it is one from these: the pipe to report its admin port on, and the pid of the
# supervisor that must outlive it.
READY_FD_ENV = "TANDEM_ROUTER_READY_FD"
SUPERVISOR_PID_ENV = "TANDEM_ROUTER_SUPERVISOR_PID"
ADMIN_HOST = "127.0.0.1"
STOP_GRACE_S = 30.0
SCRAPE_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


class PortTaken(Exception):
    """The router's port is held by another process."""


def claim_port(host: str, port: int) -> int:
    """The port the workers will share, after checking nobody else holds it: a bind without
    SO_REUSEPORT fails on any port already bound (with or without it) by another socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortTaken(f"{host}:{port} is already in use by another process ({exc})") from exc
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class WorkerLink:
    """A worker's side of the supervisor: its ready pipe and its supervisor's pid."""

    ready_fd: int
    supervisor_pid: int

    @classmethod
    def from_env(cls) -> WorkerLink | None:
        fd, pid = os.environ.get(READY_FD_ENV), os.environ.get(SUPERVISOR_PID_ENV)
        return None if fd is None or pid is None else cls(int(fd), int(pid))

    def bind_to_supervisor(self) -> None:
        """Receive SIGTERM when the supervisor dies; exit now if it already has."""
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != self.supervisor_pid:
            raise SystemExit("tandem router: the supervisor exited before this worker started")

    def ready(self, admin_port: int) -> None:
        os.write(self.ready_fd, f"{admin_port}\n".encode())
        os.close(self.ready_fd)


def _write_all(fd: int, data: bytes) -> None:
    """Write `data` to the pipe `fd` and close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass  # the worker exited first; its ready pipe says so
    finally:
        os.close(fd)


@dataclass
class Worker:
    """One worker slot: its current process and its history."""

    index: int
    process: asyncio.subprocess.Process | None = None
    admin_port: int | None = None  # set while it serves

    @property
    def admin_url(self) -> str | None:
        return None if self.admin_port is None else f"http://{ADMIN_HOST}:{self.admin_port}"

    exits: list[float] = field(default_factory=list)
    restarts: int = 0


class Supervisor:
    """Starts, restarts and stops the worker processes of one router and serves its admin port."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.workers = [Worker(i) for i in range(config.processes)]
        self.admin = HttpServer(self.handle_admin, 1024, config.http)
        self.port = 0
        self.admin_port = 0
        self._worker_config = b""
        self._keepers: list[asyncio.Task[None]] = []
        # Kept-alive connections to the workers' private admin ports, for /metrics and /engines.
        self.admin_clients = Upstreams(connect_timeout=SCRAPE_TIMEOUT_S)

    async def start(self) -> None:
        """Claim the port, start every worker and wait until each serves; raise if one cannot."""
        self.port = claim_port(self.config.host, self.config.port)
        self._worker_config = (
            worker_config(self.config, self.port).model_dump_json(by_alias=True).encode()
        )
        admin_port = self.config.trust.admin_port
        assert admin_port is not None  # RouterConfig requires it with several processes
        self.admin_port = await self.admin.start(self.config.host, admin_port)
        started = await asyncio.gather(*(self._spawn(w) for w in self.workers))
        if not all(started):
            raise RuntimeError("a router worker exited while starting (its log says why)")
        self._keepers = [asyncio.create_task(self._keep(w)) for w in self.workers]
        log.info(
            "router listening on %s:%d with %d processes, admin on %d",
            self.config.host,
            self.port,
            len(self.workers),
            self.admin_port,
        )

    async def stop(self) -> None:
        for keeper in self._keepers:
            keeper.cancel()
        await asyncio.gather(*self._keepers, return_exceptions=True)
        await self._stop_workers()
        await self.admin.close()
        self.admin_clients.close()

    # -- workers -----------------------------------------------------------------------------

    async def _spawn(self, worker: Worker) -> bool:
        """Start `worker`'s process; True once it serves, False if it exited first."""
        read_fd, write_fd = os.pipe()
        config_in, config_out = os.pipe()  # a pipe, not the loop's socket: /dev/stdin opens it
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tandem.cli",
                "router",
                "--config",
                "/dev/stdin",  # no file to leave behind, no keys on disk
                stdin=config_in,
                pass_fds=(write_fd,),
                env={
                    **os.environ,
                    READY_FD_ENV: str(write_fd),
                    SUPERVISOR_PID_ENV: str(os.getpid()),
                },
                # Signals from a terminal reach the supervisor only; it stops the workers.
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            os.close(config_out)
            raise
        finally:
            os.close(write_fd)
            os.close(config_in)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        try:
            await loop.run_in_executor(None, _write_all, config_out, self._worker_config)
            line = await reader.readline()  # b"" when the worker exits before reporting
        finally:
            transport.close()
        if not line.strip():
            await worker.process.wait()
            return False
        worker.admin_port = int(line)
        log.info("router process %d (pid %d) serves", worker.index, worker.process.pid)
        return True

    async def _keep(self, worker: Worker) -> None:
        """Restart `worker` whenever it exits, until the supervisor stops."""
        while True:
            process = worker.process
            assert process is not None
            code = await process.wait()
            if worker.admin_url is not None:
                self.admin_clients.drop(worker.admin_url)
            worker.admin_port = None
            now = time.monotonic()
            worker.exits.append(now)
            del worker.exits[:-16]
            delay = restart_delay(worker.exits, now)
            log.warning(
                "router process %d (pid %d) exited with %s; restarting in %.2f s",
                worker.index,
                process.pid,
                code,
                delay,
            )
            await asyncio.sleep(delay)
            worker.restarts += 1
            try:
                await self._spawn(worker)
            except OSError:  # could not even start it (fds, memory): count it as an exit
                log.exception("router process %d could not be started", worker.index)

    async def _stop_workers(self) -> None:
        running = [
            w.process
            for w in self.workers
            if w.process is not None and w.process.returncode is None
        ]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in running]
        if not waits:
            return
        _, late = await asyncio.wait(waits, timeout=STOP_GRACE_S)
        for process in running:
            if process.returncode is None:
                log.warning("router process pid %d did not stop; killing it", process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        if late:
            await asyncio.wait(late)

    def _serving(self) -> list[Worker]:
        return [w for w in self.workers if w.admin_port is not None]

    # -- admin port --------------------------------------------------------------------------

    async def handle_admin(self, request: Request, responder: Responder) -> None:
        """/livez: a worker is alive; /health: a worker is healthy; /metrics and /engines: every
        worker's, merged."""
        path = request.path
        serving = self._serving()
        if path == "/livez":
            ok = bool(serving)
            responder.send(200 if ok else 503, b"" if ok else error_body(503, "no router process"))
        elif path in ("/health", "/ping"):
            answers = await self._ask(serving, "/health")
            ok = any(status == 200 for _, status, _ in answers)
            responder.send(
                200 if ok else 503, b"" if ok else error_body(503, "no healthy router process")
            )
        elif path == "/metrics":
            answers = await self._ask(serving, "/metrics")
            families = merge_families(
                [(str(w.index), body.decode()) for w, status, body in answers if status == 200]
            )
            responder.send(
                200,
                render_families([*families, *self._own_metrics()]),
                content_type="text/plain; version=0.0.4; charset=utf-8",
            )
        elif path == "/engines":
            answers = await self._ask(serving, "/engines")
            views = [
                (str(w.index), json.loads(body)) for w, status, body in answers if status == 200
            ]
            if views:
                responder.send(200, json.dumps(merge_engine_views(views)).encode())
            else:
                responder.send(503, error_body(503, "no router process"))
        else:
            responder.send(404, b'{"detail":"Not Found"}')

    async def _ask(self, workers: list[Worker], path: str) -> list[tuple[Worker, int, bytes]]:
        """Each worker's answer to `path`; a worker that fails to answer is left out."""

        async def one(worker: Worker) -> tuple[Worker, int, bytes] | None:
            url = worker.admin_url
            if url is None:
                return None
            try:
                pool = self.admin_clients.pool(url)
                response = await pool.request("GET", path, idle_s=SCRAPE_TIMEOUT_S)
                return worker, response.status, await response.read()
            except UpstreamError:
                return None

        answers = await asyncio.gather(*(one(w) for w in workers))
        return [a for a in answers if a is not None]

    def _own_metrics(self) -> Iterable[Metric]:
        restarts = CounterMetricFamily(
            "tandem_router_process_restarts",
            "Router worker processes restarted after they exited.",
            labels=["process"],
        )
        for worker in self.workers:
            restarts.add_metric([str(worker.index)], worker.restarts)
        alive = GaugeMetricFamily(
            "tandem_router_processes_alive", "Router worker processes serving."
        )
        alive.add_metric([], len(self._serving()))
        configured = GaugeMetricFamily(
            "tandem_router_processes", "Router worker processes configured."
        )
        configured.add_metric([], len(self.workers))
        return (restarts, alive, configured)


async def supervise(config: RouterConfig) -> int:
    """Run `config.processes` router processes until SIGTERM or SIGINT; the exit status."""
    supervisor = Supervisor(config)
    try:
        await supervisor.start()
    except (PortTaken, RuntimeError, OSError) as exc:
        log.error("tandem router: %s", exc)
        await supervisor.stop()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping %d router processes", len(supervisor.workers))
    await supervisor.stop()
    return 0
