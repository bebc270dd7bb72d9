"""Replays golden/single byte for byte against the emulator and compares the answers' shapes.

Same status lines, content types, framing (Content-Length vs one HTTP chunk per SSE event),
JSON field sets and types, error bodies, and /metrics names, types, labels and buckets.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from emu_harness import (
    GOLDEN,
    TINY_ARGS,
    Emulator,
    counter_values,
    emulator,
    golden_request,
    shape,
)

pytestmark = pytest.mark.timeout(60)
SINGLE = GOLDEN / "single"
CASES = (
    sorted(p.name[: -len(".req.http")] for p in SINGLE.glob("*.req.http"))
    if SINGLE.is_dir()
    else []
)


def exchange(port: int, raw: bytes) -> bytes:
    raw = re.sub(rb"Host: [^\r\n]+", f"Host: 127.0.0.1:{port}".encode(), raw, count=1)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(raw)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def parse(response: bytes) -> tuple[int, dict[str, str], list[bytes], bytes]:
    """(status, headers, HTTP chunks or [], de-chunked body)."""
    head, _, rest = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if headers.get("transfer-encoding") != "chunked":
        return status, headers, [], rest
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2 :]
    return status, headers, chunks, b"".join(chunks)


def sse_payloads(body: bytes) -> list[str]:
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


@pytest.mark.parametrize("case", [c for c in CASES if c != "99_metrics"])
def test_exchange_matches_golden(tiny: Emulator, case: str) -> None:
    golden = parse((SINGLE / f"{case}.resp.http").read_bytes())
    mine = parse(exchange(tiny.port, (SINGLE / f"{case}.req.http").read_bytes()))
    g_status, g_headers, _g_chunks, g_body = golden
    status, headers, chunks, body = mine
    assert status == g_status
    assert headers.get("content-type") == g_headers.get("content-type")
    assert ("transfer-encoding" in headers) == ("transfer-encoding" in g_headers)
    if g_headers.get("content-type", "").startswith("text/event-stream"):
        # one HTTP chunk per SSE event, as uvicorn sends them
        assert all(
            c.startswith(b"data: ") and c.endswith(b"\n\n") and c.count(b"\n\n") == 1
            for c in chunks
        )
        g_events, events = sse_payloads(g_body), sse_payloads(body)
        g_chunks_json = [json.loads(e) for e in g_events[:-1]]
        chunks_json = [json.loads(e) for e in events[:-1]]
        assert shape(chunks_json[0]) == shape(g_chunks_json[0])
        assert shape(chunks_json[-1]) == shape(g_chunks_json[-1])
        middle = {json.dumps(shape(c), sort_keys=True) for c in chunks_json[1:-1]}
        g_middle = {json.dumps(shape(c), sort_keys=True) for c in g_chunks_json[1:-1]}
        assert middle <= g_middle | {json.dumps(shape(g_chunks_json[-1]), sort_keys=True)}
        assert sum(1 for c in chunks_json if c["choices"] and c["choices"][0]["finish_reason"]) == 1
        return
    if not g_body:
        assert body == b""
        return
    g_json, my_json = json.loads(g_body), json.loads(body)
    assert shape(my_json) == shape(g_json)
    if "error" in g_json or "detail" in g_json or case in ("02_version", "04_tokenize"):
        assert my_json == g_json
    if case in ("05_completions", "06_chat_completions"):
        assert my_json["usage"] == g_json["usage"]


def metric_families(text: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """name -> (type, label names, bucket bounds) for the vllm:* families of an exposition."""
    types = dict(re.findall(r"^# TYPE (vllm:\S+) (\S+)$", text, re.M))
    out: dict[str, tuple[str, frozenset[str], tuple[str, ...]]] = {}
    for name, kind in types.items():
        if name.endswith("_created"):
            continue
        sample = f"{name}_bucket" if kind == "histogram" else name
        labels: set[str] = set()
        bounds: list[str] = []
        for line in text.splitlines():
            if line.startswith(sample + "{"):
                found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
                labels.update(found)
                if kind == "histogram" and found.get("engine") == "0":
                    bounds.append(found["le"])
        labels.discard("le")
        out[name] = (kind, frozenset(labels), tuple(dict.fromkeys(bounds)))
    return out


@pytest.mark.parametrize(
    "golden_file",
    [Path("single/99_metrics.txt"), Path("pd/main/99_decode_metrics_final.txt")],
    ids=["single", "pd-decode"],
)
def test_metrics_names_types_labels_buckets(tiny: Emulator, golden_file: Path) -> None:
    import httpx

    golden = metric_families((GOLDEN / golden_file).read_text())
    if "pd" in golden_file.parts:
        mine = metric_families(pd_metrics_text())
    else:
        mine = metric_families(httpx.get(tiny.url + "/metrics").text)
    skipped = {"vllm:cache_config_info"}  # same name and type; its labels are vLLM's config fields
    for name, (kind, labels, bounds) in golden.items():
        assert name in mine, name
        assert mine[name][0] == kind, name
        if name not in skipped:
            assert mine[name][1] == labels, name
            assert mine[name][2] == bounds, name
    assert "engine" in mine["vllm:cache_config_info"][1]
    assert "block_size" in mine["vllm:cache_config_info"][1]


def pd_metrics_text() -> str:
    """/metrics of a decode engine (with the NIXL families), rendered in-process."""
    from tandem.emulator.metrics import EngineMetrics, build_registry, render

    metrics = EngineMetrics("tiny", kv_connector=True)
    metrics.cache_config_info = {"block_size": "32"}
    for histogram in (h for _, h in metrics.histograms()):
        histogram.observe(1.0)
    return render(build_registry(metrics)).decode()


def test_same_traffic_gives_vllms_counters() -> None:
    """Requests 05 to 09 on a fresh engine leave exactly golden 99_metrics' non-timing values."""
    import httpx

    with emulator(TINY_ARGS) as proc:
        for name in CASES:
            if name[:2] in ("05", "06", "07", "08", "09"):
                path, body = golden_request(SINGLE / f"{name}.req.http")
                assert httpx.post(proc.url + path, json=body, timeout=20).status_code == 200
        mine = counter_values(httpx.get(proc.url + "/metrics").text)
    golden = counter_values((SINGLE / "99_metrics.txt").read_text())
    differing = {k: (mine.get(k), v) for k, v in golden.items() if mine.get(k) != v}
    assert not differing
