"""Real vLLM 0.32 (CPU build) under the engine container's rendered security context.

No container runtime here: scripts/run-as-engine-container.sh reproduces the context (the
rendered uid, no capabilities, no_new_privs, read-only root filesystem, writable HOME, /tmp and
/dev/shm) in a private mount namespace; the seccomp profile is the runtime's and is not applied.
vLLM then takes its key from VLLM_API_KEY, set from the Secret; the rendered command line has none.
Runs in the real-vLLM tier (root, the tier's network namespace and its hold on the real-vLLM lock).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import EXAMPLE, VLLM_PYTHON, PDCluster
from tandem_process import MODEL_DIR, ROOT

from tandem.common.ports import free_port
from tandem.operator.api import ServingCluster
from tandem.operator.common_render import ENGINE_KEY_ENV
from tandem.operator.manifest import load_manifest
from tandem.operator.render import render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = ROOT / "scripts" / "run-as-engine-container.sh"
MODEL = "/mnt/model"  # MODEL_DIR, where run-as-engine-container.sh shows it (the model volume)


def _engine(pd_cluster: ServingCluster) -> tuple[dict[str, Any], dict[str, Any]]:
    [deployment] = [
        o
        for o in render(pd_cluster)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "llama-8b-decode"
    ]
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_vllm_serves_under_the_rendered_engine_context(pd_cluster: PDCluster) -> None:
    pd_cluster.stop()  # at most two vLLM engines on this machine: the shared pair makes room
    pod, container = _engine(load_manifest(EXAMPLE.parent / "llama-8b-pd.yaml"))
    uid = container["securityContext"]["runAsUser"]
    assert uid == pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    home = {e["name"]: e for e in container["env"]}["HOME"]["value"]
    port, key = free_port(), "engine-key-e2e"
    argv = [
        "unshare", "-m", "--propagation", "private", str(SCRIPT), str(uid), home,
        "--model", str(MODEL_DIR), "--",
        "env", f"{ENGINE_KEY_ENV}={key}", "PYTHONHASHSEED=0", "HF_HUB_OFFLINE=1",
        "VLLM_CPU_KVCACHE_SPACE=1",
        VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server",
        "--model", MODEL, "--load-format", "dummy", "--served-model-name", "tiny",
        "--block-size", "32", "--enforce-eager", "--max-model-len", "512",
        "--dtype", "float32",  # as examples/tiny-vllm.yaml says why: no AMX attention kernel
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    assert "--api-key" not in container["args"]
    log = Path(f"/tmp/tandem-engine-context-{port}.log")
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        served = httpx.post(
            f"{url}/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
        # What --api-key leaves open on vLLM 0.32 (docs/security.md): the NetworkPolicy's part.
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        server = subprocess.run(
            ["pgrep", "-f", f"api_server --model {MODEL}.*--port {port}"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert key not in Path(f"/proc/{server[0]}/cmdline").read_text()
        status = Path(f"/proc/{server[0]}/status").read_text()
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        assert fields["Uid"].split()[0] == str(uid)
        assert fields["CapEff"].strip() == "0000000000000000"
        assert fields["CapBnd"].strip() == "0000000000000000"
        assert fields["NoNewPrivs"].strip() == "1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
