"""Whether a decode engine's answer failed before any output, as a failed KV pull does.

When the prefill pod's KV cannot be pulled (the pod died after answering, the NIXL handshake timed
out), vLLM 0.32 with `kv_load_failure_policy: fail` answers a non-streaming request with a 5xx and
a streaming one with `200`, an error event and `[DONE]` (docs/protocols.md §1, golden/pd/). Such an
answer has produced nothing for the client yet, so the router may send the request once more
without the prefill's `kv_transfer_params` and let the decode engine prefill it itself.
"""

from __future__ import annotations

import msgspec

_decode_json = msgspec.json.Decoder().decode


def failed_before_output(status: int, streaming: bool, first_chunk: bytes) -> bool:
    """True for a non-streaming answer with status >= 500, and for a stream whose first event is
    `data: {"error": ...}` (an event that does not parse, e.g. cut by the chunking, is output)."""
    if not streaming:
        return status >= 500
    event = first_chunk.lstrip().split(b"\n\n", 1)[0]
    if not event.startswith(b"data:"):
        return False
    try:
        payload = _decode_json(event[len(b"data:") :])
    except msgspec.DecodeError:
        return False
    return isinstance(payload, dict) and "error" in payload
