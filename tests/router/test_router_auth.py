"""API keys: the router admits clients by the keys in a file it re-reads, and presents the engine
key to engines that demand it (the emulator's --api-key behaves as vLLM's on /v1)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from router_harness import Engine, Router, running

from tandem.router.auth import ClientAuth, EngineKey, KeyFile, parse_keys


def test_parse_keys_skips_blanks_and_comments() -> None:
    assert parse_keys("# clients\nalpha\n\n  beta  \n#gamma\n") == ("alpha", "beta")


def test_client_auth_checks_bearer_keys_and_fails_closed(tmp_path: Path) -> None:
    assert ClientAuth().allows(None)  # nothing configured: open
    static = ClientAuth(["k1"])
    assert static.allows("Bearer k1")
    assert static.allows("bearer k1")
    assert not static.allows("Bearer k2")
    assert not static.allows("Basic k1")
    assert not static.allows(None)
    missing = ClientAuth(key_file=KeyFile(tmp_path / "absent"))
    assert missing.enforced
    assert not missing.allows("Bearer anything")  # a configured file with no key admits nobody


def test_key_file_follows_rotation_and_keeps_keys_through_a_gap(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "keys"
    path.write_text("one\n")
    keys = KeyFile(path, recheck_s=1.0, clock=lambda: now[0])
    assert keys.keys() == ("one",)
    path.write_text("two\nthree\n")
    assert keys.keys() == ("one",)  # not re-checked before recheck_s
    now[0] = 1.0
    assert keys.keys() == ("two", "three")
    path.unlink()  # the kubelet swapping a Secret's files: never seen as "no keys"
    now[0] = 2.0
    assert keys.keys() == ("two", "three")


def test_kubelet_style_symlink_swap_is_seen(tmp_path: Path) -> None:
    """A Secret volume: key -> ..data/key, ..data -> a timestamped dir swapped atomically."""
    now = [0.0]
    for version, content in (("v1", "old\n"), ("v2", "new\n")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "api-key").write_text(content)
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "api-key").symlink_to("..data/api-key")
    engine = EngineKey(KeyFile(tmp_path / "api-key", clock=lambda: now[0]))
    assert engine.header() == ("authorization", "Bearer old")
    (tmp_path / "..data_tmp").symlink_to("v2")
    (tmp_path / "..data_tmp").rename(tmp_path / "..data")
    now[0] = 5.0
    assert engine.header() == ("authorization", "Bearer new")


def _wait_healthy(router: Router) -> None:
    """The engine's /health is open (vLLM guards /v1 only): the router marks it healthy."""
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)


def _chat(url: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_router_admits_file_keys_rotates_them_and_sends_the_engine_key(tmp_path: Path) -> None:
    engine_key = tmp_path / "engine-key"
    engine_key.write_text("engine-secret\n")
    client_keys = tmp_path / "client-keys"
    client_keys.write_text("alice\nbob\n")
    engine = Engine(None, extra=["--api-key", "engine-secret"])
    router = Router(
        [
            "--worker", engine.url,
            "--client-keys-file", str(client_keys),
            "--engine-key-file", str(engine_key),
        ]
    )  # fmt: skip
    with running(engine, router):
        _wait_healthy(router)
        assert _chat(engine.url, None).status_code == 401  # the engine alone is useless
        assert _chat(router.url, None).status_code == 401
        assert _chat(router.url, "mallory").status_code == 401
        assert httpx.get(router.url + "/v1/models").status_code == 401
        for key in ("alice", "bob"):
            response = _chat(router.url, key)
            assert response.status_code == 200, response.text  # the engine got its key
        client_keys.write_text("bob\ncarol\n")  # revoke alice, add carol: no restart
        deadline = time.monotonic() + 10
        while _chat(router.url, "alice").status_code != 401 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _chat(router.url, "alice").status_code == 401
        assert _chat(router.url, "carol").status_code == 200
        assert _chat(router.url, "bob").status_code == 200


def test_router_without_the_engine_key_is_refused_by_the_engine() -> None:
    engine = Engine(None, extra=["--api-key", "engine-secret"])
    router = Router(["--worker", engine.url])
    with running(engine, router):
        _wait_healthy(router)
        assert _chat(router.url, None).status_code == 401
