"""The KV handoff: what a prefill engine is asked for, and the check of what it answered.

A prefill answer's `kv_transfer_params` tell the decode engine where to pull the KV from
(`remote_host`:`remote_port`, the prefill engine's NIXL side channel). The router relays them only
when they name the engine that answered, so neither a compromised engine nor anything that can
stand in for one can point a decode engine at another host.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

import msgspec

from tandem.router.engines import Engine

_encode_json = msgspec.json.Encoder().encode
# What a prefill engine is asked for: produce the KV, hand it off (docs/router.md, P/D handoff).
_PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> bytes:
    """The client's body turned into a prefill-only request (max_tokens=1, non-streaming, KV kept)."""
    request = dict(body)
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        request.pop(key, None)
    request["kv_transfer_params"] = _PREFILL_KV_PARAMS
    return _encode_json(request)


def _same_host(a: str, b: str) -> bool:
    """Equal hosts; any two loopback names count as one (vLLM's default side-channel host is
    `localhost` while engines are often addressed as 127.0.0.1)."""
    a, b = a.strip("[]").lower(), b.strip("[]").lower()
    if a == b:
        return True
    return _loopback(a) and _loopback(b)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def handoff_problem(params: object, engine: Engine) -> str | None:
    """Why `params` must not be relayed to a decode engine, or None when they may.

    Relayable: a JSON object whose `remote_host` is the answering engine's host and whose
    `remote_port` is its configured side-channel port.
    """
    if not isinstance(params, dict):
        return "no kv_transfer_params (is the prefill engine a kv_producer?)"
    host = params.get("remote_host")
    port = params.get("remote_port")
    expected = urlsplit(engine.url).hostname or ""
    if not isinstance(host, str) or not _same_host(host, expected):
        return f"remote_host {host!r} is not the prefill engine's host {expected!r}"
    if isinstance(port, bool) or port != engine.side_channel_port:
        return f"remote_port {port!r} is not the prefill engine's side channel {engine.side_channel_port}"
    return None
