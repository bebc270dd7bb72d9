"""API keys: the clients' keys the router accepts, and the engine key it presents upstream.

Both come from files (a mounted Kubernetes Secret in a pod) that are re-read when they change, so
keys rotate without a restart. The kubelet updates a Secret volume by swapping a symlink
(`..data`), which gives the file a new inode; `stat` sees that, or a new size or mtime, at most
`recheck_s` after it happened.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tandem.router.config import RouterConfig

log = logging.getLogger("tandem.router.auth")

AUTHORIZATION = "authorization"


def parse_keys(text: str) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with # are ignored, spaces trimmed."""
    lines = (line.strip() for line in text.splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


class KeyFile:
    """The keys in one file, re-read whenever the file changes (checked at most every `recheck_s`).

    A file that cannot be read keeps the keys last read (a Secret update is never half-seen as
    "no keys"); one that was never readable yields no keys.
    """

    def __init__(
        self, path: str | Path, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path)
        self.recheck_s = recheck_s
        self._clock = clock
        self._checked = float("-inf")
        self._stamp: tuple[int, int, int, int] | None = None
        self._keys: tuple[str, ...] = ()

    def keys(self) -> tuple[str, ...]:
        now = self._clock()
        if now - self._checked >= self.recheck_s:
            self._checked = now
            self._reload()
        return self._keys

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return
            keys = parse_keys(self.path.read_text())
        except OSError as exc:
            if self._stamp is not None or not self._keys:
                log.warning("cannot read API keys from %s: %s", self.path, exc.strerror or exc)
            return
        if self._stamp is not None and keys != self._keys:
            log.info("API keys in %s changed: %d key(s)", self.path, len(keys))
        self._stamp, self._keys = stamp, keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ClientAuth:
    """Checks `Authorization: Bearer KEY` against static keys and a key file.

    Enforced when either is configured; a configured file that holds no key admits nobody (fails
    closed). Keys are compared as SHA-256 digests with `secrets.compare_digest`, against every key,
    so the time taken does not tell which key or how much of one matched.
    """

    def __init__(self, static_keys: Iterable[str] = (), key_file: KeyFile | None = None) -> None:
        self._static = tuple(_digest(k) for k in static_keys)
        self._file = key_file
        self._file_keys: tuple[str, ...] = ()
        self._file_digests: tuple[bytes, ...] = ()

    @classmethod
    def from_config(cls, config: RouterConfig) -> ClientAuth:
        path = config.auth.client_keys_file
        return cls(config.api_keys, KeyFile(path) if path else None)

    @property
    def enforced(self) -> bool:
        return bool(self._static) or self._file is not None

    def _digests(self) -> tuple[bytes, ...]:
        if self._file is None:
            return self._static
        keys = self._file.keys()
        if keys is not self._file_keys:
            self._file_keys, self._file_digests = keys, tuple(_digest(k) for k in keys)
        return self._static + self._file_digests

    def allows(self, authorization: str | None) -> bool:
        if not self.enforced:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        given = _digest(key.strip())
        matched = False
        for digest in self._digests():
            matched |= secrets.compare_digest(given, digest)
        return matched


class EngineKey:
    """The key the router sends to engines as `Authorization: Bearer KEY` (vLLM's --api-key):
    the first key of a file, or a fixed key."""

    def __init__(self, key_file: KeyFile | None = None, key: str | None = None) -> None:
        self._file = key_file
        self._fixed = (key,) if key else ()
        self._key: str | None = None
        self._header: tuple[str, str] | None = None

    @classmethod
    def from_config(cls, config: RouterConfig) -> EngineKey | None:
        auth = config.auth
        if auth.engine_key_file:
            return cls(KeyFile(auth.engine_key_file))
        return cls(key=auth.engine_key) if auth.engine_key else None

    def header(self) -> tuple[str, str] | None:
        """The Authorization header, or None while the key file holds no key."""
        keys = self._file.keys() if self._file is not None else self._fixed
        key = keys[0] if keys else None
        if key != self._key:
            self._key = key
            self._header = (AUTHORIZATION, f"Bearer {key}") if key else None
        return self._header
