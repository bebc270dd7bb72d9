"""The real-vLLM tier: one prefill/decode pair of real vLLM 0.32 engines (CPU build) shared by the
whole session, with `tandem router` in front.

Run it with `make test-vllm` (scripts/test-vllm.sh): that installs vLLM, takes the machine's
real-vLLM lock and runs this folder inside a network namespace of its own.
"""

from __future__ import annotations

import socket
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from harness import VLLM_PYTHON, PDCluster, make_llama3_style_model, plan_tiny_cluster

from tandem.local.logs import failure_excerpt

# Tests that kill engines run after those that share them; those that start engines of their own
# (LoRA, `tandem up`, the engine security context) stop the shared pair and run last.
MODULE_ORDER = [
    "test_pd",
    "test_epp",
    "test_parity",
    "test_replicas",
    "test_predictive",
    "test_render",
    "test_failures",
    "test_lora",
    "test_shutdown",
    "test_up",
    "test_engine_context",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    items.sort(key=rank)


@pytest.fixture(scope="session", autouse=True)
def _own_network_namespace() -> None:
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if not VLLM_PYTHON or interfaces != ["lo"]:
        pytest.fail(
            "the real-vLLM tier runs through `make test-vllm` (scripts/test-vllm.sh): it needs "
            "TANDEM_VLLM_PYTHON and a network namespace of its own (interfaces here: "
            f"{', '.join(interfaces)})"
        )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama3_style_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def pd_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    run_dir = tmp_path_factory.mktemp("pd")
    cluster = PDCluster(plan_tiny_cluster(model_dir, run_dir), run_dir)
    try:
        cluster.ensure_engines()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _pair_serving(request: pytest.FixtureRequest) -> None:
    """A test module that uses the shared pair starts with its running engines serving, not
    merely answering /health."""
    if "pd_cluster" in request.fixturenames:
        request.getfixturevalue("pd_cluster").ensure_serving(request.module.__name__)


@pytest.fixture
def pd(pd_cluster: PDCluster) -> PDCluster:
    """The pair, both engines healthy."""
    pd_cluster.ensure_engines()
    return pd_cluster


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the last lines of every router and engine still running, so
    that a failure in CI shows what the processes saw."""
    report = yield
    if report.when == "call" and report.failed:
        for pair in PDCluster.pairs:
            for router in pair.routers:
                if router.proc.poll() is None:
                    report.sections.append((f"{router.name} output", router.output()))
            for engine in (pair.prefill, pair.decode):
                if engine.alive():
                    excerpt = failure_excerpt(engine.log_text(), tail_lines=60)
                    report.sections.append((f"{engine.spec.name} log", excerpt))
    return report
