"""benchmarks/router_trace.py refuses a run it could not finish before it starts any router."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from router_trace import check_llmd_binaries


def test_llmd_binaries_are_checked_before_the_run(tmp_path: Path) -> None:
    epp = tmp_path / "epp"
    epp.write_text("#!/bin/sh\n")
    envoy = tmp_path / "envoy"
    with pytest.raises(SystemExit, match="needs --llmd-epp PATH"):
        check_llmd_binaries(None, envoy)
    with pytest.raises(SystemExit, match=f"--llmd-epp {epp}: no executable there"):
        check_llmd_binaries(epp, envoy)  # epp is not executable yet
    epp.chmod(0o755)
    with pytest.raises(SystemExit, match=f"--envoy {envoy}: no executable there"):
        check_llmd_binaries(epp, envoy)
    envoy.write_text("#!/bin/sh\n")
    envoy.chmod(0o755)
    check_llmd_binaries(epp, envoy)
