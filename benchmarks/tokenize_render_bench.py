"""In-process chat rendering against delegating to vLLM's renderer, side by side in one run.

    flock /tmp/tandem-realvllm.lock .venv/bin/python benchmarks/tokenize_render_bench.py \
        --vllm-python "$(scripts/ensure-vllm.sh)" [--requests 300]

Starts vLLM 0.32's GPU-less renderer (`vllm launch render`) on the Llama 3.1 fixture model of the
tokenization corpus (tests/router/fixtures/tokenization/models/llama3.1) and builds two router
featurizers for the same model: in-process (template + tokenizer in the router) and remote
(`renderMode: remote`, every request to `/v1/chat/completions/render` over the router's pooled
HTTP client). Requests alternate in-process / remote, one at a time, so both see the same machine
noise. Every request is distinct (a counter in the user turn, no cache hit), with a shared system
prompt, a few turns and one tool, the shape of an agent's chat request (~1,700 tokens of the
fixture's small byte-level vocabulary; the model's max_model_len is 2,048).

Figures per request: added latency (wall time of producing the token ids, p50 and p90), and CPU
seconds (in-process: the router's own process CPU; remote: the router's process CPU plus the
renderer's whole process CPU from /proc over the same requests). The ids of both paths are compared
on every request. Output: a table and docs/records/tokenize-render-<UTC>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.router.features import Featurizer  # noqa: E402
from tandem.router.render_client import RenderClient  # noqa: E402

MODEL = ROOT / "tests/router/fixtures/tokenization/models/llama3.1"
KWARGS = {"date_string": "26 Jul 2024"}
SYSTEM = " ".join(
    f"Rule {i}: answer precisely, cite the source document, and keep units consistent."
    for i in range(14)
)
TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge base.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}


def request(i: int) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Ticket {i}: the invoice total looks wrong."},
            {"role": "assistant", "content": "Which invoice number is it?"},
            {"role": "user", "content": f"Invoice {i * 7919 % 100000}, dated last Tuesday."},
        ],
        "tools": [TOOL],
        "tool_choice": "none",
        "max_tokens": 64,
    }


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(url: str, renderer_pid: int, n: int) -> dict[str, object]:
    local = Featurizer(32, str(MODEL), cache_size=1, chat_template_kwargs=KWARGS)
    client = RenderClient(url, timeout_s=30)
    failures: list[str] = []
    remote = Featurizer(
        32, None, cache_size=1, render=client, render_all=True, on_fallback=failures.append
    )
    for i in range(20):  # warm both paths (template compile, connections)
        await local.features(request(-i), True)
        await remote.features(request(-i), True)
    lat: dict[str, list[float]] = {"in-process": [], "render API": []}
    cpu = {"in-process": 0.0, "render API": 0.0}
    mismatches = 0
    for i in range(n):
        body = request(i)
        c0, t0 = time.process_time(), time.perf_counter()
        a = await local.features(body, True)
        t1, c1 = time.perf_counter(), time.process_time()
        r0 = cpu_of(renderer_pid)
        b = await remote.features(body, True)
        t2, c2 = time.perf_counter(), time.process_time()
        r1 = cpu_of(renderer_pid)
        lat["in-process"].append(t1 - t0)
        lat["render API"].append(t2 - t1)
        cpu["in-process"] += c1 - c0
        cpu["render API"] += (c2 - c1) + (r1 - r0)
        mismatches += a.keys != b.keys or a.prompt_tokens != b.prompt_tokens
    client.close()
    if failures:
        raise SystemExit(f"the renderer refused {len(failures)} requests; see the renderer log")
    return {
        "requests": n,
        "prompt_tokens": a.prompt_tokens,
        "mismatches": mismatches,
        "paths": {
            k: {
                "p50_ms": statistics.median(v) * 1e3,
                "p90_ms": percentile(v, 0.9) * 1e3,
                "cpu_ms_per_request": cpu[k] / n * 1e3,
            }
            for k, v in lat.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "tandem-render-bench.log"
    proc = subprocess.Popen(
        [args.vllm_python, "-m", "vllm.entrypoints.launchers.render.entry", "--model", str(MODEL),
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
         "--default-chat-template-kwargs", json.dumps(KWARGS)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"renderer did not start; see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        result = asyncio.run(run(f"http://127.0.0.1:{port}", proc.pid, args.requests))
    finally:
        proc.terminate()
        proc.wait(30)
    result["load_average"] = os.getloadavg()
    result["machine_cores"] = os.cpu_count()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%MZ")
    out = ROOT / "docs/records" / f"tokenize-render-{stamp}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['requests']} chat requests of {result['prompt_tokens']} tokens, "
          f"ids differing: {result['mismatches']}, load average {result['load_average']}")  # fmt: skip
    print(f"{'path':<12}{'p50 ms':>10}{'p90 ms':>10}{'CPU ms/req':>12}")
    for name, figures in result["paths"].items():  # type: ignore[attr-defined]
        print(f"{name:<12}{figures['p50_ms']:>10.3f}{figures['p90_ms']:>10.3f}"
              f"{figures['cpu_ms_per_request']:>12.3f}")  # fmt: skip
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
