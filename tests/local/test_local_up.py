"""`tandem up` as a user runs it: start an example, answer through the router, Ctrl-C, nothing left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(150)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def proc_files(name: str) -> dict[int, bytes]:
    """{pid: contents of /proc/<pid>/<name>} for every process that can be read right now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                found[int(entry.name)] = (entry / name).read_bytes()
    return found


def stat_fields(stat: bytes) -> list[bytes]:
    """The fields after the parenthesised command name: state, ppid, pgrp, ..."""
    return stat.rsplit(b")", 1)[1].split()


def descendants(root: int) -> set[int]:
    """Every live process below `root` (children of children included)."""
    parents = {pid: int(stat_fields(stat)[1]) for pid, stat in proc_files("stat").items()}
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def processes_with(marks: list[bytes]) -> list[int]:
    """Live processes whose command line contains any of `marks` (NUL-separated arguments)."""
    return [
        pid
        for pid, cmdline in proc_files("cmdline").items()
        if any(m in cmdline for m in marks) and alive(pid)
    ]


def alive(pid: int) -> bool:
    try:
        state = stat_fields((Path("/proc") / str(pid) / "stat").read_bytes())[0]
    except OSError:
        return False
    return state != b"Z"


def wait_for_line(process: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} from tandem up:\n{''.join(lines)}")


@pytest.mark.parametrize("example", ["llama-8b-pd.yaml", "llama-8b-colocated.yaml"])
def test_up_serves_through_the_router_and_stops_clean_on_ctrl_c(
    example: str, tmp_path: Path
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "tandem.cli", "up", str(EXAMPLES / example), "--speedup", "20",
               "--port", str(port), "--prefill", "1", "--decode", "1", "--run-dir", str(tmp_path)]  # fmt: skip
    env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    children: set[int] = set()
    try:
        output = wait_for_line(process, "ready", 90)
        assert f"http://127.0.0.1:{port}" in "".join(output)
        children = descendants(process.pid)
        assert len(children) >= (3 if example == "llama-8b-pd.yaml" else 2)
        long_prompt = " ".join(["word"] * 600)  # long enough for the P/D path in auto mode
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "llama-8b",
                "messages": [{"role": "user", "content": long_prompt}],
                "max_tokens": 8,
            },
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        if example == "llama-8b-pd.yaml":
            assert response.headers.get("x-tandem-route") in {"disaggregated", "pd"}
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        rest, _ = process.communicate()
        assert "stopped" in rest
        assert (tmp_path / "router.yaml").is_file()
        assert {p.name for p in (tmp_path / "logs").glob("*.log")} >= {"router.log"}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "tandem up left processes behind"


def test_up_with_bench_reports_writes_plots_and_stops(tmp_path: Path) -> None:
    """The README's first command, shortened: start, benchmark through the router, report, stop."""
    command = [sys.executable, "-m", "tandem.cli", "up", str(EXAMPLES / "llama-8b-pd.yaml"), "--speedup", "20",
               "--prefill", "1", "--decode", "1", "--port", str(free_port()), "--run-dir", str(tmp_path / "run"),
               "--bench", "quick", "--bench-args", "--num-requests 12 --qps 12 --warmup 2 --quiet",
               "--out", str(tmp_path / "bench")]  # fmt: skip
    env = os.environ | {"COLUMNS": "200"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "requests ok / failed" in done.stdout
    assert "stopped llama-8b" in done.stdout
    assert {p.name for p in (tmp_path / "bench").iterdir()} == {
        "llama-8b.json", "latency_cdf.png", "timeseries.png", "breakdown.png", "resources.png",
    }  # fmt: skip
    # the engines' emulated GPUs and the processes that `tandem up` started are all monitored
    assert "first to saturate" in done.stdout or "no resource reached" in done.stdout
    assert "process:router" in done.stdout
    # Orphans would have been re-parented away from us: look for the run's own command lines.
    config = yaml.safe_load((tmp_path / "run" / "router.yaml").read_text())
    ports = [
        e["url"].rsplit(":", 1)[1] for e in config["static"]["prefill"] + config["static"]["decode"]
    ]
    marks = [str(tmp_path / "run").encode()] + [f"--port\0{p}\0".encode() for p in ports]
    assert not processes_with(marks), "tandem up left processes behind"


def test_up_runs_the_gateway_of_clusters_that_join_one(tmp_path: Path) -> None:
    base = yaml.safe_load((EXAMPLES / "llama-8b-colocated.yaml").read_text())
    files = []
    for served in ("alpha", "beta"):
        manifest = yaml.safe_load(yaml.safe_dump(base))
        manifest["metadata"]["name"] = served
        manifest["spec"]["model"]["servedName"] = served
        manifest["spec"]["gateway"] = {"name": "models"}
        path = tmp_path / f"{served}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        files.append(str(path))
    command = [sys.executable, "-m", "tandem.cli", "up", *files, "--speedup", "20",
               "--decode", "1", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    children: set[int] = set()
    try:
        output = "".join(wait_for_line(process, "ready", 120))
        line = next(line for line in output.splitlines() if "gateway models:" in line)
        url = line.split()[2]
        assert line.endswith("serves alpha, beta"), line
        children = descendants(process.pid)
        for model in ("alpha", "beta"):
            body = {"model": model, "prompt": "hello", "max_tokens": 4}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
        unknown = httpx.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"].endswith("Valid aliases: alpha, beta.")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "tandem up left processes behind"
