#!/usr/bin/env bash
# The real-vLLM tier: real vLLM 0.32 (CPU build, installed and cached by scripts/ensure-vllm.sh)
# behind `tandem router`, run inside a network namespace of its own so the engines' `tcp://*`
# endpoints reach nothing but its loopback, and under the machine's real-vLLM lock (at most two
# engines at a time). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
VLLM_PYTHON=$(scripts/ensure-vllm.sh | tail -n 1)
export TANDEM_VLLM_PYTHON=$VLLM_PYTHON
# One wall-clock bound for the whole tier, lock wait included: nothing here may hang CI.
exec timeout --kill-after=30 "${TANDEM_VLLM_TIER_TIMEOUT_S:-2700}" \
    flock /tmp/tandem-realvllm.lock \
    unshare --net -- bash -c 'ip link set lo up && exec "$0" -m pytest -p no:cacheprovider tests/realvllm "$@"' \
    "$PYTHON" "$@"
