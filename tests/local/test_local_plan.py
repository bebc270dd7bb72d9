"""The local plan from the example manifests: ports, flags, environment and the router's static config."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from tandem_process import MODEL_DIR

from tandem.local.cluster import load_cluster, parse_set
from tandem.local.devices import DeviceError, EngineNeed, Machine, assign_devices
from tandem.local.plan import LocalOptions, build_plan, localize_env
from tandem.local.up import main as up_main
from tandem.operator.manifest import ManifestError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def counter() -> itertools.count[int]:
    return itertools.count(20000)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_pd_example_becomes_prefill_and_decode_engines_behind_a_static_router(
    tmp_path: Path,
) -> None:
    sc = load_cluster(EXAMPLES / "llama-8b-pd.yaml")
    options = LocalOptions(
        timing_profile="h200-llama-3.1-8b", speedup=5, router_port=18000, python="py"
    )
    plan = build_plan(sc, options, counter().__next__, tmp_path, {"HF_TOKEN": "t", "PATH": "/bin"})
    assert [e.name for e in plan.engines] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    ports = [e.port for e in plan.engines] + [
        int(e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for e in plan.engines
    ]
    assert len(set(ports)) == len(ports)
    prefill = plan.engines[0]
    argv = prefill.argv
    assert argv[:5] == ["py", "-m", "tandem.cli", "emulate", "meta-llama/Llama-3.1-8B-Instruct"]
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", str(prefill.port))
    assert json.loads(flag(argv, "--kv-transfer-config"))["kv_role"] == "kv_producer"
    events = json.loads(flag(argv, "--kv-events-config"))
    # Still a binding endpoint (`*`), on this engine's own port, bound to loopback by the emulator.
    assert events["endpoint"] == f"tcp://*:{prefill.kv_events.rsplit(':', 1)[1]}"  # type: ignore[union-attr]
    assert argv[-6:] == [
        "--timing-profile",
        "h200-llama-3.1-8b",
        "--speedup",
        "5",
        "--kv-events-bind-host",
        "127.0.0.1",
    ]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert prefill.env["PYTHONHASHSEED"] == sc.spec.engine.hash_seed
    assert prefill.env["HF_TOKEN"] == "t"  # the secret's variable, taken from the local environment

    config = plan.router_config
    assert config.kubernetes is None
    assert config.static is not None
    assert (config.host, config.port) == ("127.0.0.1", 18000)
    assert [e.url for e in config.static.prefill] == [e.url for e in plan.engines[:2]]
    assert [e.kv_events for e in config.static.decode] == [e.kv_events for e in plan.engines[2:]]
    assert config.disaggregation.mode == "auto"
    assert config.scoring.prefix_weight == 3
    assert plan.router.argv[-2:] == ["--config", str(tmp_path / "router.yaml")]
    assert set(plan.metrics_urls()) == {"router", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    # The engine key: one random key per run, given to every engine and to the router.
    key = config.auth.engine_key
    assert key
    for engine in plan.engines:
        assert key not in " ".join(engine.argv)  # the environment only: not visible in ps
        assert engine.env["VLLM_API_KEY"] == key
        assert "HOME" not in engine.env or engine.env["HOME"] != "/home/vllm"
        assert "UCX_TCP_PORT_RANGE" not in engine.env
    assert config.auth.engine_key_file is None


def test_colocated_example_runs_workers_and_replica_overrides_apply(tmp_path: Path) -> None:
    sc = load_cluster(EXAMPLES / "llama-8b-colocated.yaml")
    plan = build_plan(
        sc,
        LocalOptions(decode_replicas=1, engine="vllm", vllm_python="py"),
        counter().__next__,
        tmp_path,
        {},
    )
    assert [(e.name, e.role) for e in plan.engines] == [("worker-0", "worker")]
    assert plan.engines[0].argv[:5] == [
        "py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
    ]
    assert "--kv-transfer-config" not in plan.engines[0].argv
    assert plan.router_config.static is not None
    assert [e.url for e in plan.router_config.static.workers] == [plan.engines[0].url]
    assert "HF_TOKEN" not in plan.engines[0].env  # no local value: left out, not invented


def test_the_router_predicts_each_engine_at_the_step_budget_the_engine_runs_with(
    tmp_path: Path,
) -> None:
    """`tandem up` renders the engines and the router from one manifest: a decode pool of
    2048-token steps is predicted at 2048, the prefill pool at its own budget."""
    sc = load_cluster(
        EXAMPLES / "llama-8b-pd.yaml",
        ["spec.decode.maxNumBatchedTokens=2048", "spec.prefill.maxNumBatchedTokens=16384"],
    )
    plan = build_plan(sc, LocalOptions(speedup=5), counter().__next__, tmp_path, {})
    predictive = plan.router_config.scoring.predictive
    for engine in plan.engines:
        expected = predictive.chunk_tokens(prefill_only=engine.role == "prefill")
        assert int(flag(engine.argv, "--max-num-batched-tokens")) == expected
    assert (predictive.prefill_chunk_tokens, predictive.prefill_pool_chunk_tokens) == (2048, 16384)


def test_set_overrides_are_validated_like_the_manifest() -> None:
    sc = load_cluster(
        EXAMPLES / "llama-8b-pd.yaml",
        ["spec.router.scoring.prefixWeight=0", "spec.prefill.replicas=1"],
    )
    assert (sc.spec.router.scoring.prefix_weight, sc.spec.prefill.replicas) == (0, 1)
    with pytest.raises(ManifestError, match=r"decode\.replicas"):
        load_cluster(EXAMPLES / "llama-8b-pd.yaml", ["spec.decode.replicas=-1"])
    with pytest.raises(ValueError, match="PATH=VALUE"):
        parse_set("spec.decode.replicas")


def test_several_router_processes_get_an_admin_port_for_their_merged_metrics(
    tmp_path: Path,
) -> None:
    sc = load_cluster(EXAMPLES / "llama-8b-pd.yaml", ["spec.router.processes=2"])
    plan = build_plan(sc, LocalOptions(), counter().__next__, tmp_path, {})
    assert plan.router_config.processes == 2
    admin = plan.router_config.trust.admin_port
    assert admin is not None
    assert admin == plan.router_admin_port != plan.router.port
    assert plan.metrics_urls()["router"] == f"http://127.0.0.1:{admin}/metrics"
    single = build_plan(
        load_cluster(EXAMPLES / "llama-8b-pd.yaml"),
        LocalOptions(),
        counter().__next__,
        tmp_path,
        {},
    )
    assert single.router_config.trust.admin_port is None
    assert single.metrics_urls()["router"] == f"{single.router.url}/metrics"


def test_localize_env_resolves_field_refs() -> None:
    env = [
        {"name": "A", "value": "1"},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ]
    local = localize_env(env, "decode-3", {"SECRET": "x", "KEEP": "y"})
    assert local == {"A": "1", "IP": "127.0.0.1", "POD": "decode-3", "SECRET": "x", "KEEP": "y"}


def test_asking_for_vllm_from_an_interpreter_without_it_is_refused_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # This test suite's own interpreter has no vLLM (the real-vLLM tier has its own).
    argv = [str(EXAMPLES / "llama-8b-pd.yaml"), "--engine", "vllm", "--vllm-python", sys.executable]
    assert up_main(argv) == 2
    assert "vLLM is not installed for" in capsys.readouterr().err


def test_vllm_engines_get_gpus_of_their_own_by_tensor_parallel_size(tmp_path: Path) -> None:
    sc = load_cluster(EXAMPLES / "llama-8b-pd.yaml", ["spec.decode.tensorParallelSize=2"])
    machine = Machine(gpus=("0", "1", "2", "3", "4", "5"), cores=(0, 1), cpu_build=False)
    options = LocalOptions(engine="vllm", vllm_python="vpy", machine=machine)
    plan = build_plan(sc, options, counter().__next__, tmp_path, {"CUDA_VISIBLE_DEVICES": "0-5"})
    assert {e.name: e.env["CUDA_VISIBLE_DEVICES"] for e in plan.engines} == {
        "prefill-0": "0",
        "prefill-1": "1",
        "decode-0": "2,3",
        "decode-1": "4,5",
    }
    assert plan.engines[0].argv[:3] == ["vpy", "-m", "vllm.entrypoints.openai.api_server"]
    assert plan.router.argv[0] == sys.executable  # the router stays on tandem's interpreter
    with pytest.raises(DeviceError, match="need 7 GPU"):
        build_plan(
            sc,
            LocalOptions(engine="vllm", machine=machine, prefill_replicas=3),
            counter().__next__,
            tmp_path,
            {},
        )


def test_cpu_engines_get_disjoint_cores_and_their_own_ports(tmp_path: Path) -> None:
    sc = load_cluster(EXAMPLES / "tiny-vllm.yaml", [f"spec.model.name={MODEL_DIR}"])
    machine = Machine(gpus=(), cores=(0, 1, 2, 3, 4, 5, 6, 7), cpu_build=True)
    plan = build_plan(
        sc, LocalOptions(engine="vllm", machine=machine), counter().__next__, tmp_path, {}
    )
    binds = [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in plan.engines]
    assert binds == ["0-3", "4-7"]
    sides = [e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in plan.engines]
    events = [json.loads(flag(e.argv, "--kv-events-config"))["endpoint"] for e in plan.engines]
    assert len(set(sides)) == len(set(events)) == 2
    assert all(e.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" for e in plan.engines)
    decode = json.loads(flag(plan.engines[1].argv, "--kv-transfer-config"))
    assert decode["kv_load_failure_policy"] == "recompute"
    # The model directory has tokenizer.json: the router tokenizes exactly, as the engines do.
    assert plan.router_config.tokenizer == sc.spec.model.name


def test_device_shares_split_cores_per_rank_and_refuse_too_few() -> None:
    machine = Machine(gpus=(), cores=(0, 1, 2, 3, 8, 9), cpu_build=True)
    assert assign_devices([EngineNeed("p", 2), EngineNeed("d", 1)], machine) == {
        "p": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "d": {"VLLM_CPU_OMP_THREADS_BIND": "3,8-9"},
    }
    assert assign_devices([EngineNeed("w", 1)], machine) == {
        "w": {"VLLM_CPU_OMP_THREADS_BIND": "0-3,8-9"}
    }
    with pytest.raises(DeviceError, match="cores of their own"):
        assign_devices([EngineNeed(f"e{i}", 1) for i in range(7)], machine)


def test_a_hub_model_on_vllm_gets_its_tokenizer_fetched_before_the_router_starts(
    tmp_path: Path,
) -> None:
    sc = load_cluster(EXAMPLES / "llama-8b-pd.yaml")
    machine = Machine(gpus=("0", "1", "2", "3"), cores=(0,), cpu_build=False)
    options = LocalOptions(engine="vllm", vllm_python="vpy", machine=machine)
    plan = build_plan(sc, options, counter().__next__, tmp_path, {"HF_TOKEN": "t"})
    fetch = plan.tokenizer_fetch
    assert fetch is not None
    assert fetch.argv[:2] == ["vpy", "-c"]  # vLLM's interpreter has huggingface_hub
    assert fetch.argv[3:5] == ["meta-llama/Llama-3.1-8B-Instruct", ""]
    assert fetch.argv[5] == str(tmp_path / "tokenizer") == plan.router_config.tokenizer
    assert fetch.env["HF_TOKEN"] == "t"
    emulated = build_plan(sc, LocalOptions(), counter().__next__, tmp_path, {})
    assert emulated.tokenizer_fetch is None
    assert emulated.router_config.tokenizer == "tandem-fallback"
