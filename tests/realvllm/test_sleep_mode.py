"""What vLLM 0.32's CPU build says to --enable-sleep-mode: it refuses to start.

So this tier cannot check sleep and wake against the real engine; the emulator's sleep mode
(tests/emulator/test_emulator_sleep.py) follows vLLM's sources and the H200 measurement instead.
"""

from __future__ import annotations

import os
import subprocess

from harness import VLLM_PYTHON
from tandem_process import MODEL_DIR

from tandem.common.ports import free_port


def test_cpu_build_refuses_sleep_mode_at_start() -> None:
    argv = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
        "--host", "127.0.0.1", "--port", str(free_port()), "--max-model-len", "512",
        "--enable-sleep-mode",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert done.returncode != 0
    assert "Sleep mode is not supported on current platform." in done.stdout + done.stderr
