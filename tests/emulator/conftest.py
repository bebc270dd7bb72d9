"""Fixtures of the emulator tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from emu_harness import TINY_ARGS, Emulator, emulator


@pytest.fixture(scope="module")
def tiny() -> Iterator[Emulator]:
    """An aggregated emulator launched like golden/single's vLLM server."""
    with emulator(TINY_ARGS) as proc:
        yield proc
