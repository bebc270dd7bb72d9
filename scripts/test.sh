#!/usr/bin/env bash
# The whole test suite, as CI runs it: tools, lint, types, then every test (unit, integration over
# real sockets, and end-to-end on a real control plane). Any failure, or no test at all, is red.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

step "tools: Prometheus, control-plane binaries"
scripts/ensure-prometheus.sh
scripts/ensure-haproxy.sh
e2e/cluster/build.sh

step "lint"
$BIN/ruff check .
$BIN/ruff format --check .
$BIN/lint-imports

step "types"
$BIN/mypy -p tandem

step "tests"
# Most of the suite waits on the processes it starts (engines, routers, a control plane), so it
# runs on more workers than cores: the e2e suite whole on one, test modules shared by the others
# (conftest.py). pytest exits 5 when it collects nothing; set -e turns that into a failure too.
$BIN/pytest -p no:cacheprovider -n "${TANDEM_TEST_WORKERS:-3}" "$@"

step "real vLLM (make test-vllm)"
scripts/test-vllm.sh
