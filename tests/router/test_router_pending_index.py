"""Pending index entries: blocks sent to an engine count for it until events confirm them or
their deadline passes (see index.py)."""

from __future__ import annotations

from tandem.router.index import PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pending_blocks_count_until_their_deadline() -> None:
    clock = Clock()
    index = PrefixIndex(pending_ttl_s=2.0, clock=clock)
    index.add_pending("a", [1, 2, 3])
    assert index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 0}
    clock.now += 1.9
    assert index.match([1, 2], ["a"]) == {"a": 2}
    clock.now += 0.2
    assert index.match([1, 2], ["a"]) == {"a": 0}
    assert index.pending_size("a") == 0


def test_an_event_confirms_pending_blocks() -> None:
    clock = Clock()
    index = PrefixIndex(pending_ttl_s=2.0, clock=clock)
    index.add_pending("a", [1, 2, 3])
    index.store("a", [1, 2])  # the engine's BlockStored events
    assert index.pending_size("a") == 1
    clock.now += 5
    # confirmed blocks stay; the unconfirmed one expired
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}
    index.remove("a", [2])
    assert index.match([1, 2, 3], ["a"]) == {"a": 1}


def test_stored_blocks_are_not_made_pending_again() -> None:
    index = PrefixIndex(pending_ttl_s=2.0, clock=Clock())
    index.store("a", [1])
    index.add_pending("a", [1, 2])
    assert index.pending_size("a") == 1
    index.remove("a", [1])  # evicted on the engine: no pending entry keeps it alive
    assert index.match([1, 2], ["a"]) == {"a": 0}


def test_a_burst_follows_the_first_request_while_events_are_in_flight() -> None:
    index = PrefixIndex(pending_ttl_s=10.0, clock=Clock())
    index.store("b", [9])  # unrelated content elsewhere
    prefix = [11, 12, 13, 14]
    hits = []
    for tail in range(5):
        keys = [*prefix, 100 + tail]
        match = index.match(keys, ["a", "b"])
        engine = max(match, key=lambda e: (match[e], e == "a"))
        index.add_pending(engine, keys)
        hits.append(match[engine])
    assert hits == [0, 4, 4, 4, 4]


def test_clear_and_drop_engine_forget_pending_blocks() -> None:
    index = PrefixIndex(pending_ttl_s=10.0, clock=Clock())
    index.add_pending("a", [1, 2])
    index.add_pending("b", [1])
    index.clear("a")
    assert index.match([1, 2], ["a", "b"]) == {"a": 0, "b": 1}
    index.drop_engine("b")
    assert index.match([1], ["a", "b"]) == {"a": 0, "b": 0}


def test_an_engine_that_refused_a_connection_holds_nothing_pending() -> None:
    """What the proxy does when an engine refuses a connection: the requests behind its pending
    blocks never reached it, so they must not draw the next requests to it once it is back."""
    index = PrefixIndex(pending_ttl_s=10.0, clock=Clock())
    index.add_pending("a", [1, 2])
    index.store("a", [7])
    index.add_pending("b", [1])
    index.clear_pending("a")
    assert index.match([1, 2], ["a", "b"]) == {"a": 0, "b": 1}
    assert index.match([7], ["a"]) == {"a": 1}  # what its events confirmed stays


def test_pending_entries_are_bounded_per_engine() -> None:
    index = PrefixIndex(max_blocks_per_engine=16, pending_ttl_s=10.0, clock=Clock())
    index.add_pending("a", range(40))
    assert index.pending_size("a") == 16
    assert index.match([39], ["a"]) == {"a": 1}
    assert index.match([0], ["a"]) == {"a": 0}
