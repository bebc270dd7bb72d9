"""Session affinity: a bounded map from a client's session id to the decode engine it last used."""

from __future__ import annotations

from collections import OrderedDict

# Bytes one entry costs besides its two strings (dict slot, OrderedDict link, str headers):
# measured with tracemalloc on CPython 3.11-3.12, rounded up.
ENTRY_OVERHEAD_BYTES = 200


class SessionTable:
    """At most `max_sessions` entries and `max_bytes` of them; least recently used go first.

    An entry costs len(session) + ENTRY_OVERHEAD_BYTES; engine ids are shared strings (one per
    engine), so they do not count per entry.
    """

    def __init__(self, max_sessions: int, max_bytes: int = 16 * 1024 * 1024):
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.bytes = 0
        self._engines: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, session: str) -> str | None:
        engine = self._engines.get(session)
        if engine is not None:
            self._engines.move_to_end(session)
        return engine

    def put(self, session: str, engine: str) -> None:
        if session not in self._engines:
            self.bytes += len(session) + ENTRY_OVERHEAD_BYTES
        self._engines[session] = engine
        self._engines.move_to_end(session)
        while self._engines and (
            len(self._engines) > self.max_sessions or self.bytes > self.max_bytes
        ):
            old, _ = self._engines.popitem(last=False)
            self.bytes -= len(old) + ENTRY_OVERHEAD_BYTES

    def forget_engine(self, engine: str) -> None:
        for session in [s for s, e in self._engines.items() if e == engine]:
            del self._engines[session]
            self.bytes -= len(session) + ENTRY_OVERHEAD_BYTES
