"""A backend that costs nothing and a load generator that costs little: nginx and wrk.

nginx (Debian nginx-light) answers every POST /v1/completions with one fixed vLLM-shaped
completion, /health with 200 and /metrics with the two vLLM gauges routers read, so every router
sees a healthy, idle engine; it runs as a child process (`daemon off; master_process off`) from
its own prefix directory. wrk (Debian) POSTs a short non-streaming completion over keep-alive
connections for a fixed number of seconds and prints its latency percentiles and counts as JSON
(its Lua `done` hook). Cores are given with `taskset -c`, so the process and every thread it
starts stay on them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

NGINX = os.environ.get("NGINX", shutil.which("nginx") or "/usr/sbin/nginx")
WRK = os.environ.get("WRK", shutil.which("wrk") or "/usr/bin/wrk")
MODEL = "tiny"

# What vLLM 0.32 answers for a one-token completion (fields as in tests/fixtures/vllm-0.32/single).
COMPLETION = json.dumps(
    {
        "id": "cmpl-0123456789abcdef0123456789abcdef",
        "object": "text_completion",
        "created": 1764547200,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": " world",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": 6, "total_tokens": 7, "completion_tokens": 1},
        "kv_transfer_params": None,
    },
    separators=(",", ":"),
)
METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
)
REQUEST = json.dumps(
    {"model": MODEL, "prompt": "ping 12345 hello", "max_tokens": 1, "temperature": 0},
    separators=(",", ":"),
)


def _nginx_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def nginx_config(port: int, prefix: Path) -> str:
    return f"""
daemon off;
master_process off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        location = /v1/completions {{
            default_type application/json;
            return 200 {_nginx_string(COMPLETION)};
        }}
        location = /v1/models {{
            default_type application/json;
            return 200 {_nginx_string(json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))};
        }}
        location = /health {{ return 200 ''; }}
        location = /metrics {{
            default_type text/plain;
            return 200 {_nginx_string(METRICS)};
        }}
        location / {{ return 404; }}
    }}
}}
"""


def nginx_argv(port: int, prefix: Path, cores: list[int] | None) -> list[str]:
    """The command of one nginx answering as an idle vLLM engine on 127.0.0.1:`port`, its
    configuration written into the directory `prefix` (where it keeps its files), on `cores`."""
    config = prefix / "nginx.conf"
    config.write_text(nginx_config(port, prefix))
    return pinned([NGINX, "-p", str(prefix), "-c", str(config), "-e", "stderr"], cores)


def pinned(argv: list[str], cores: list[int] | None) -> list[str]:
    """`argv` under `taskset -c` (the process and all its threads stay on `cores`)."""
    if not cores:
        return argv
    return ["taskset", "-c", ",".join(map(str, cores)), *argv]


# wrk's Lua hooks: POST the body; print the summary as one JSON line at the end.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  io.write(string.format(
    '{"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,"max_us":%%d,' ..
    '"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.status, summary.errors.timeout))
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    p50_s: float
    p90_s: float
    p99_s: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def wrk(
    url: str, connections: int, seconds: float, threads: int, cores: list[int] | None
) -> WrkResult:
    """A closed loop of `connections` keep-alive connections for `seconds` (bounded by wrk -d)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % json.dumps(REQUEST))
    try:
        argv = [WRK, "-t", str(min(threads, connections)), "-c", str(connections),
                "-d", f"{seconds:g}s", "--timeout", "10s", "-s", script.name,
                url + "/v1/completions"]  # fmt: skip
        done = subprocess.run(
            pinned(argv, cores), capture_output=True, text=True, timeout=seconds + 60, check=False
        )
    finally:
        os.unlink(script.name)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith('{"requests"')), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    row = json.loads(line)
    errors = sum(row[k] for k in ("connect", "read", "write", "status", "timeout"))
    return WrkResult(
        row["requests"],
        row["duration_us"] / 1e6,
        row["p50_us"] / 1e6,
        row["p90_us"] / 1e6,
        row["p99_us"] / 1e6,
        errors,
    )


def _siblings(cpu: int) -> set[int]:
    """The logical CPUs sharing `cpu`'s physical core (hyperthreads), `cpu` included."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return {cpu}
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus | {cpu}


def core_plan(router_cores: int) -> tuple[list[int], list[int], list[int]]:
    """(router, nginx, wrk) CPUs out of this process's: the router gets one hyperthread of each
    of `router_cores` physical cores, whose other hyperthreads stay idle (a core budget is whole
    cores, not shared with the load); nginx gets a quarter of the rest (at least one), wrk the
    others. On a machine too small to keep them apart, nginx and wrk share what is left."""
    cpus = sorted(os.sched_getaffinity(0))
    router: list[int] = []
    reserved: set[int] = set()
    for cpu in cpus:
        if len(router) == router_cores:
            break
        if cpu not in reserved:
            router.append(cpu)
            reserved |= _siblings(cpu)
    rest = [c for c in cpus if c not in reserved] or cpus[-1:]
    backend = rest[: max(1, len(rest) // 4)]
    load = rest[len(backend) :] or backend
    return router, backend, load
