"""Rendezvous hashing, the affinity scorer and session placement: pure functions, no sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from test_router_plan import _config, _inputs

from tandem.common.routing import ScoringConfig
from tandem.router.decision import plan_route
from tandem.router.engines import Engine
from tandem.router.rendezvous import hrw_order, weight
from tandem.router.scorers.affinity import affinity_score
from tandem.router.scoring import score_engines

IDS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def _engines(depths: dict[str, int] | None = None) -> list[Engine]:
    depths = depths or {}
    return [
        Engine(url, frozenset({"decode"}), in_flight=depths.get(url, 0), pending=depths.get(url, 0))
        for url in IDS
    ]


def _plan(
    engines: list[Engine], config: dict[str, object] | None = None, **extra: object
) -> Engine:
    inputs = _inputs(engines, [], prompt_tokens=200, total_blocks=12, **extra)
    plan = plan_route(inputs, _config(**(config or {})))
    assert plan is not None
    return plan.decode.engine


def test_weight_is_stable_across_processes_and_hash_seeds() -> None:
    here = [weight("session-7", url) for url in IDS] + [weight(2**63 + 5, IDS[0])]
    assert all(0.0 <= w < 1.0 for w in here)
    code = (
        "from tandem.router.rendezvous import weight;"
        f"print(repr([weight('session-7', u) for u in {IDS!r}] + [weight(2**63 + 5, {IDS[0]!r})]))"
    )
    elsewhere = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert eval(elsewhere) == here  # the child printed a list of floats


def test_hrw_spreads_keys_evenly_and_moves_only_the_removed_engines_keys() -> None:
    first = {k: hrw_order(k, IDS, str)[0] for k in range(4000)}
    counts = Counter(first.values())
    assert all(800 <= n <= 1200 for n in counts.values()), counts  # ~1000 each
    survivors = IDS[1:]
    after = {k: hrw_order(k, survivors, str)[0] for k in range(4000)}
    moved = [k for k in first if first[k] != after[k]]
    assert moved
    assert all(first[k] == IDS[0] for k in moved)
    assert all(after[k] == hrw_order(k, IDS, str)[1] for k in moved)  # to their next engine


def test_a_session_stays_on_its_top_engine_while_healthy_or_within_its_bound() -> None:
    session = "conversation-42"
    order = hrw_order(session, IDS, str)
    assert _plan(_engines(), session=session).id == order[0]
    # whatever the prefix hits say and whichever order the pool is listed in
    engines = _engines()[::-1]
    assert _plan(engines, session=session, hits={order[-1]: 12}).id == order[0]
    # busier than the load bound allows (12 > 1.5 * 3 + 1): a session stays while its engine is
    # healthy, where a request without one would not go
    assert _plan(_engines({order[0]: 12}), session=session).id == order[0]
    assert _plan(_engines({order[0]: 12}), first_block_key=1).id != order[0]
    # with a session load bound, over it (12 > 2 * 3 + 1): the next in HRW order, on every replica
    bounded = {"scoring": {"sessionLoadBoundFactor": 2}}
    assert _plan(_engines({order[0]: 12}), config=bounded, session=session).id == order[1]
    # within it (2 <= 2 * 0.5 + 1), though over the ordinary bound (2 > 1.5 * 0.5 + 1)
    assert _plan(_engines({order[0]: 2}), config=bounded, session=session).id == order[0]
    assert _plan(_engines({order[0]: 2}), first_block_key=1).id != order[0]
    # its engine unhealthy (not a candidate): the next one too
    without = [e for e in _engines() if e.id != order[0]]
    assert _plan(without, session=session).id == order[1]


def test_a_new_prefix_goes_to_its_rendezvous_engine_whatever_each_replica_has_in_flight() -> None:
    """Replicas see different router-side loads (each counts only its own requests) and, until
    KV events arrive (or never, without them), different indexes: a prefix no candidate holds goes
    to its first block's rendezvous engine within the load bound, so replicas agree on it."""
    for key in range(200):
        top = hrw_order(key, IDS, str)[0]
        picks = {
            _plan(_engines(depths), first_block_key=key).id
            for depths in ({}, {top: 1}, {IDS[0]: 1}, {IDS[1]: 1}, {IDS[2]: 1}, {IDS[3]: 1})
        }
        assert picks == {top}
    idle = Counter(_plan(_engines(), first_block_key=key).id for key in range(400))
    assert len(idle) == 4
    assert min(idle.values()) >= 70


def test_a_real_prefix_hit_dominates_affinity() -> None:
    weights = ScoringConfig()
    engines = _engines()
    for key in range(50):
        last = hrw_order(key, IDS, str)[-1]
        ranked = score_engines(engines, {last: 6}, 12, weights, None, key)
        assert ranked[0].engine.id == last  # half the prompt cached beats any affinity
    assert affinity_score(7, IDS[0]) == weight(7, IDS[0])
    # without a full block there is no key: exact ties are broken at random, not by engine order
    picks = {score_engines(engines, {}, 0, weights)[0].engine.id for _ in range(200)}
    assert len(picks) == 4


def test_a_new_prefix_moves_down_its_rendezvous_order_past_the_load_bound() -> None:
    for key in range(50):
        order = hrw_order(key, IDS, str)
        busy = _engines({order[0]: 2, order[1]: 1})  # within the bound (1.5 * 0.75 + 1)
        assert _plan(busy, first_block_key=key).id == order[0]
        over = _engines({order[0]: 5})  # over it: the next engine in HRW order
        assert _plan(over, first_block_key=key).id == order[1]
        # a prefix an engine holds is scored as usual
        seen = _plan(busy, first_block_key=key, hits={order[2]: 12})
        assert seen.id == order[2]
