"""Session affinity: a bounded map from a client's session id to the decode engine it last used."""

from __future__ import annotations

from collections import OrderedDict


class SessionTable:
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._engines: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        engine = self._engines.get(session)
        if engine is not None:
            self._engines.move_to_end(session)
        return engine

    def put(self, session: str, engine: str) -> None:
        self._engines[session] = engine
        self._engines.move_to_end(session)
        while len(self._engines) > self.max_sessions:
            self._engines.popitem(last=False)

    def forget_engine(self, engine: str) -> None:
        for session in [s for s, e in self._engines.items() if e == engine]:
            del self._engines[session]
