"""Plugins for every suite of the repository (tests/ and e2e/), and how the suite is spread over
pytest-xdist's workers (`-n`, as scripts/test.sh runs it)."""

from typing import Any

import pytest

pytest_plugins = ["tests.repository_reads"]


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: the e2e suite (its session fixtures, a control plane and
    a Helm release, start once, and tests of one file build on each other's objects), else one
    test module (its module-scoped fixtures start once, its tests keep their order)."""
    return "e2e" if nodeid.startswith("e2e/") else nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The e2e suite first: it is the longest chain of the run (about 6 minutes on two cores),
    so under xdist it starts at once on one worker while the others share the rest."""
    items.sort(key=lambda item: work_unit(item.nodeid) != "e2e")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with `work_unit` as the scope, handing units out in collection
    order (not largest first: a module of a thousand quick cases would go before the e2e suite).
    `--dist loadgroup` cannot keep the e2e suite whole on pytest 9, where the item nodeid it
    rewrites is no longer the one its scheduler reads."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)
