"""benchmarks/router_trace.py refuses a run it could not finish before it starts any router."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from router_bench import TANDEM_POLICIES, check_before_tree
from router_trace import check_llmd_binaries
from router_trace_report import TANDEM_ROUTERS, router_kind


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


def test_a_before_router_needs_a_tandem_tree(tmp_path: Path) -> None:
    assert router_kind("tandem-predictive@before") == "tandem-predictive"
    assert router_kind("sglang") == "sglang"
    check_before_tree(["tandem", "sglang"], None, TANDEM_ROUTERS)  # no @before: no tree needed
    with pytest.raises(SystemExit, match="needs --before-tree DIR"):
        check_before_tree(["tandem", "tandem@before"], None, TANDEM_ROUTERS)
    with pytest.raises(SystemExit, match="needs --before-tree DIR"):
        check_before_tree(["tandem@before"], tmp_path, TANDEM_ROUTERS)  # no Tandem in it
    (tmp_path / "tandem").mkdir()
    (tmp_path / "tandem" / "cli.py").write_text("")
    check_before_tree(["tandem@before"], tmp_path, TANDEM_ROUTERS)
    with pytest.raises(SystemExit, match="only a Tandem router"):
        check_before_tree(["sglang@before"], tmp_path, TANDEM_ROUTERS)
    # router_bench.py's emulator method runs Tandem's two policies, colocated
    check_before_tree(["tandem-predictive@before"], tmp_path, TANDEM_POLICIES)
    with pytest.raises(SystemExit, match="only a Tandem router"):
        check_before_tree(["tandem-pd@before"], tmp_path, TANDEM_POLICIES)
