"""Process supervision: each child in its own process group, logs to files, /health readiness,
SIGTERM then SIGKILL of whole groups on the way out so no process outlives `tandem up`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tandem.local.logs import failure_excerpt
from tandem.local.plan import ProcessSpec


class StartupError(RuntimeError):
    """A child exited or never became healthy; the message carries its log's first error and
    last lines."""


@dataclass
class Child:
    spec: ProcessSpec
    process: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_excerpt(self, lines: int = 15) -> str:
        """The log's first error (the cause, for a vLLM engine) and its last `lines` lines."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return failure_excerpt(text, lines)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group led by `pid` (its children included); gone groups are fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Supervisor:
    """Starts children, waits for their health, watches them and stops them all."""

    def __init__(self, log_dir: Path, grace_s: float = 10.0) -> None:
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.children: list[Child] = []

    async def start(self, spec: ProcessSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(spec.argv)}\n".encode())
            log.flush()
            # A new session makes the child a process-group leader: the terminal's Ctrl-C reaches
            # only `tandem up`, which then stops each group (grandchildren included) in order.
            process = await asyncio.create_subprocess_exec(
                *spec.argv,
                env=spec.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(spec, process, log_path)
        self.children.append(child)
        return child

    async def wait_healthy(self, children: Sequence[Child], timeout_s: float) -> None:
        """Poll each child's /health until all answer 200; fail fast when one exits."""
        deadline = time.monotonic() + timeout_s
        waiting = list(children)
        async with aiohttp.ClientSession() as session:
            while waiting:
                for child in list(waiting):
                    if child.process.returncode is not None:
                        raise StartupError(
                            f"{child.spec.name} exited with status {child.process.returncode} while starting; "
                            f"from {child.log_path}:\n{child.log_excerpt()}"
                        )
                    try:
                        async with session.get(
                            f"{child.spec.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                        ) as r:
                            if r.status == 200:
                                waiting.remove(child)
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                if not waiting:
                    return
                if time.monotonic() > deadline:
                    names = ", ".join(c.spec.name for c in waiting)
                    excerpt = waiting[0].log_excerpt()
                    raise StartupError(
                        f"not healthy after {timeout_s:.0f} s: {names}; from {waiting[0].log_path}:\n{excerpt}"
                    )
                await asyncio.sleep(0.2)

    async def run_to_completion(self, spec: ProcessSpec, timeout_s: float) -> None:
        """Start `spec` and wait for it to exit 0 (an init step, such as fetching files)."""
        child = await self.start(spec)
        try:
            code = await asyncio.wait_for(child.process.wait(), timeout_s)
        except TimeoutError:
            _signal_group(child.pid, signal.SIGKILL)
            await child.process.wait()
            code = None
        finally:
            self.children.remove(child)
        if code != 0:
            raise StartupError(
                f"{spec.name} {'timed out' if code is None else f'exited with status {code}'}; "
                f"from {child.log_path}:\n{child.log_excerpt()}"
            )

    async def first_exit(self, poll_s: float = 0.5) -> Child:
        """The first child to exit on its own (for reporting a crash while serving). Children
        started later count; children ended by `stop_children` (an idle pool put to sleep) do
        not."""
        while True:
            for child in list(self.children):
                if child.process.returncode is not None:
                    return child
            await asyncio.sleep(poll_s)

    async def stop_children(self, children: Sequence[Child]) -> None:
        """SIGTERM each child's group in order, wait up to the grace period, then SIGKILL whatever
        is left, including grandchildren of exited leaders; they leave `children` first."""
        children = list(children)
        for child in children:
            if child in self.children:
                self.children.remove(child)
            if child.process.returncode is None:
                _signal_group(child.pid, signal.SIGTERM)
        waits = [asyncio.ensure_future(c.process.wait()) for c in children]
        if waits:
            await asyncio.wait(waits, timeout=self.grace_s)
        for child in children:
            _signal_group(child.pid, signal.SIGKILL)
        for wait in waits:
            if not wait.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wait, 5)

    async def stop(self) -> None:
        """Stop every child, the router first so clients stop before engines."""
        await self.stop_children(list(reversed(self.children)))
