"""One GPU shared by several emulated engines: their steps take turns (a lock file per GPU)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from pathlib import Path


class SharedGPU:
    """Engines started with the same lock path emulate engines on one GPU.

    Without MPS, CUDA time-slices the contexts of different processes: kernels of two engines
    never run at the same time, so when both have work each step waits for the other's. That is
    modelled at step granularity: an engine holds an exclusive `flock` on the path for the
    duration of each step (its simulated time), and the next step of either engine starts when
    it is released. Whoever the kernel wakes first gets the GPU next.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    async def acquire(self) -> None:
        """Wait for the GPU (flock in a worker thread, so the event loop keeps serving)."""
        loop = asyncio.get_running_loop()
        taken = loop.run_in_executor(None, fcntl.flock, self._fd, fcntl.LOCK_EX)
        try:
            await asyncio.shield(taken)
        except asyncio.CancelledError:
            # the thread may still get the lock after we are gone: give it back then
            taken.add_done_callback(lambda _: self.release())
            raise

    def release(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.release()
        with contextlib.suppress(OSError):
            os.close(self._fd)
