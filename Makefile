# Tandem's developer entry points. Everything installs itself: a fresh machine needs only
# python3 (3.11+), go and network access to the package registries.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NIXL_VERSION := 1.5.1
EXAMPLE ?= examples/llama-8b-pd.yaml

.PHONY: venv demo test test-vllm lint typecheck unit e2e cluster-binaries cluster clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# NIXL without its CUDA-torch dependency tree: the bundled UCX runs DRAM-to-DRAM on CPU.
	$(BIN)/pip install -q --no-deps nixl-cu12==$(NIXL_VERSION)
	touch $@

## The main job: an example ServingCluster on this machine, then a short benchmark.
demo: venv
	$(BIN)/tandem up $(EXAMPLE) --bench quick

## The whole test suite, exactly as CI runs it.
test: venv
	scripts/test.sh

## The real-vLLM tier alone: vLLM 0.32 (CPU build, cached by version under ~/.cache/tandem)
## behind the router, in a network namespace of its own (needs root for `unshare --net`).
test-vllm: venv
	scripts/test-vllm.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: venv
	$(BIN)/mypy -p tandem

unit: venv
	$(BIN)/pytest tests

e2e: venv
	$(BIN)/pytest e2e

## Control-plane binaries (etcd, kube-apiserver, controller-manager, scheduler, kwok, helm),
## built from Go modules and cached by version under ~/.cache/tandem.
cluster-binaries:
	e2e/cluster/build.sh

## A real control plane for poking at by hand; prints the kubeconfig path.
cluster: venv cluster-binaries
	$(BIN)/python -m e2e.harness.cluster

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
