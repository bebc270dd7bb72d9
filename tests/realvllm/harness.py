"""Real vLLM engines for the real-vLLM tier: the tiny example cluster as `tandem up` plans it, its
engines started from that plan, and `tandem router` in front of them.

The engines run the flags the operator renders (through `tandem.local.plan`), so this tier checks
the renderer against the real engine as well. Everything binds inside the tier's own network
namespace (scripts/test-vllm.sh), where `tcp://*` reaches nothing but loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import zmq
from openai._legacy_response import LegacyAPIResponse
from openai.types import Completion
from prometheus_client.parser import text_string_to_metric_families
from tandem_process import MODEL_DIR, ROOT, TandemProcess

from tandem.common.ports import free_port
from tandem.local.cluster import PortPool, load_cluster
from tandem.local.devices import probe_machine
from tandem.local.logs import failure_excerpt
from tandem.local.plan import LocalOptions, LocalPlan, ProcessSpec, build_plan
from tandem.operator.common_render import ENGINE_KEY_ENV
from tandem.router.config import RouterConfig, TrustConfig
from tandem.router.handoff import prefill_body

VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON", "")
EXAMPLE = ROOT / "examples" / "tiny-vllm.yaml"
BLOCK = 32  # the example's blockSize
STARTUP_S = 240.0
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay end marker
TIER_CONNECT_S = 10.0  # the routers' connect and health timeout here (PDCluster.router)
TIER_ENGINE_WAIT_S = 60.0  # how long the routers here hold a request for a decode engine

# Meta-Llama-3-8B-Instruct's chat template (tokenizer_config.json on the Hugging Face Hub,
# meta-llama/Meta-Llama-3-8B-Instruct): bos_token, header tokens, trimmed content.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def make_llama3_style_model(dest: Path) -> Path:
    """The golden tiny model with a Llama-3-style chat template: its three header tokens become
    special tokens after the tokenizer's last id (the model's embedding has 512 rows)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL_DIR / "config.json", dest / "config.json")
    tokenizer = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    for offset, content in enumerate(LLAMA3_SPECIAL):
        tokenizer["added_tokens"].append(
            {
                "id": max(ids) + 1 + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA3_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


# Asks a trusted router for the engines' addresses in the response headers.
DEBUG = {"x-tandem-debug": "1"}


def openai_client(url: str) -> openai.OpenAI:
    """The official client against a router at `url`; no retries, so a failure shows."""
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        timeout=120,
        max_retries=0,
        default_headers=DEBUG,  # the routers here trust every client: engine addresses come back
    )


def stream_completion(
    url: str, prompt: str, max_tokens: int
) -> LegacyAPIResponse[openai.Stream[Completion]]:
    """A streamed completion of exactly `max_tokens` tokens with usage, headers readable."""
    return openai_client(url).completions.with_raw_response.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )


def metrics_of(url: str) -> dict[str, float]:
    """A /metrics page as {"name{label=value,...}": value}, labels sorted, engine/model dropped."""
    # vLLM's API server stalls for seconds at times on this loaded machine (the routers saw 2 s of
    # silence on /health between requests): a read that waits is not what is measured.
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(sample.labels.items())
                if k not in ("engine", "model_name")
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return out


def requests_running(url: str) -> float:
    """The engine's `vllm:num_requests_running`: the requests it is computing now."""
    return metrics_of(url).get("vllm:num_requests_running", 0.0)


def stop_core_while_running(
    engine: EngineProcess,
    requests: int,
    ready: Callable[[], bool],
    ended: Callable[[], bool],
    timeout_s: float = 120.0,
) -> bool:
    """Lets `engine` compute in 0.1 s spells, its EngineCore stopped between them, until in a stop
    `ready()` holds and /metrics counts at least `requests` running: True then, the core left
    stopped (the caller kills the engine or resumes the core). False once `ended()` holds or the
    time is up, the core running. No step runs while the core is stopped, and the gauge is set
    from the outputs of the core's last step (after it dropped the requests that step finished),
    so a request counted then is unfinished however far behind its client reads: the check
    cannot come too late on a loaded machine, nor the request end before the caller acts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ended():
        engine.stop_core()
        if ready() and requests_running(engine.url) >= requests:
            return True
        engine.resume_core()
        time.sleep(0.1)
    return False


def until(ready: Callable[[], bool], timeout_s: float, interval_s: float) -> bool:
    """Whether `ready()` holds within `timeout_s`, asked every `interval_s`, and at least twice
    before the answer is no: one look at a starved router has taken longer than a whole wait
    (89 s, CI), and a look that began before the time was up says nothing of the time after."""
    deadline = time.monotonic() + timeout_s
    looks = 0
    while not ready():
        looks += 1
        if looks >= 2 and time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def prefill_directly(engine: EngineProcess, prompt: str) -> dict[str, Any]:
    """A prefill engine's answer to a `do_remote_decode` request of `prompt` (as the router sends
    it): the `kv_transfer_params` a decode engine pulls with."""
    answer = httpx.post(
        f"{engine.url}/v1/completions",
        content=prefill_body({"model": "tiny", "prompt": prompt, "max_tokens": 8}),
        headers={"content-type": "application/json", **engine.auth},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params


def decode_directly(
    engine: EngineProcess, prompt: str, params: dict[str, Any], timeout_s: float = 120
) -> dict[str, Any]:
    """A decode engine's answer of 8 tokens to `prompt`, its KV pulled with `params`."""
    answer = httpx.post(
        f"{engine.url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "ignore_eos": True,
            "kv_transfer_params": params,
        },
        headers=engine.auth,
        timeout=timeout_s,
    )
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def nixl_pulls(engine: EngineProcess) -> tuple[float, float]:
    """(NIXL transfers done, failed) of a decode engine so far."""
    seen = metrics_of(engine.url)
    return (
        seen.get("vllm:nixl_xfer_time_seconds_count", 0.0),
        seen.get("vllm:nixl_num_failed_transfers_total", 0.0),
    )


def measure(
    pd: PDCluster, routers: list[Router], path: str, bodies: list[dict[str, Any]]
) -> list[tuple[int, int, int]]:
    """(predicted hit blocks, engine hit blocks, prompt blocks) per request: the blocks the router
    predicts the request hits on the decode engine (`x-tandem-prefix-hit`) against the blocks
    that engine's own prefix cache then hits (`vllm:prefix_cache_hits_total` tokens / BLOCK).
    Request i goes through routers[i % len(routers)], one at a time, each after the KV events of
    the one before have reached every router."""
    rows = []
    for index, body in enumerate(bodies):
        router = routers[index % len(routers)]
        seqs = [r.kv_seqs() for r in routers]
        before = metrics_of(pd.decode.url)["vllm:prefix_cache_hits_total"]
        answer = httpx.post(f"{router.url}{path}", json=body, headers=DEBUG, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-tandem-decode-engine"] == pd.decode.url
        predicted, total = map(int, answer.headers["x-tandem-prefix-hit"].split("/"))
        hit_tokens = metrics_of(pd.decode.url)["vllm:prefix_cache_hits_total"] - before
        rows.append((predicted, int(hit_tokens) // BLOCK, total))
        for waiting, seen in zip(routers, seqs, strict=True):
            waiting.wait_kv_events_settled(seen)
    print(f"{path} prefix-hit parity (predicted, engine, prompt blocks): {json.dumps(rows)}")
    return rows


def assert_parity(rows: list[tuple[int, int, int]], routers: list[Router]) -> None:
    """vLLM always recomputes a prompt's last token, so a prompt of whole blocks hits one block
    fewer than it has: predictions match within one block. A mismatch shows what the `routers`
    saw and logged."""
    if not all(abs(predicted - hit) <= 1 for predicted, hit, _ in rows):
        views = "".join(
            f"\n{r.name}'s view: {r.engines()}\n{r.name}'s log:\n{r.output()}" for r in routers
        )
        raise AssertionError(f"predicted and engine hits differ: {rows}{views}")
    assert sum(hit for _, hit, _ in rows) >= 2 * len(rows), f"too few hits to mean anything: {rows}"


SYSTEM = "You answer questions about the prefix cache of a disaggregated serving stack. " * 8


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2}


def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 2}


def conversation(question: str, *earlier: str) -> list[dict[str, str]]:
    """SYSTEM, the `earlier` questions each answered "Noted.", then `question`."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in earlier:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "Noted."}]
    return [*messages, {"role": "user", "content": question}]


class EngineProcess:
    """One vLLM engine from a plan's ProcessSpec, in a process group of its own (vLLM starts an
    engine-core and a worker process below its API server: signals go to the whole group)."""

    def __init__(self, spec: ProcessSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_start = 0

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def auth(self) -> dict[str, str]:
        """The engine key the plan gives every engine (`Authorization: Bearer`), if any."""
        key = self.spec.env.get(ENGINE_KEY_ENV)
        return {"authorization": f"Bearer {key}"} if key else {}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.log_start = log.tell()
            self.proc = subprocess.Popen(
                self.spec.argv,
                env=self.spec.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        return False

    def serves(self, headers: dict[str, str]) -> str | None:
        """None when the engine renders its /metrics and answers a one-token completion within
        their bounds (a /health of 200 does not prove either: an engine core stuck on a request
        still passes it); else what failed."""
        try:
            metrics = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10)
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
            answer = httpx.post(
                f"{self.url}/v1/completions", json=body, headers=headers, timeout=60
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if metrics.status_code != 200 or answer.status_code != 200:
            return f"/metrics {metrics.status_code}, completion {answer.status_code}: {answer.text}"
        return None

    def wait_healthy(self, timeout_s: float = STARTUP_S) -> None:
        def healthy() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.spec.name} exited while starting:\n{self.startup_log()}")
            return self.healthy()

        if not until(healthy, timeout_s, 0.5):
            raise TimeoutError(
                f"{self.spec.name} not healthy in {timeout_s} s:\n{self.startup_log()}"
            )

    def startup_log(self) -> str:
        """This start's first error and last lines (an engine restarted appends to its log)."""
        with self.log_path.open("rb") as log:
            log.seek(self.log_start)
            return failure_excerpt(log.read().decode(errors="replace"), tail_lines=30)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def core_pids(self) -> list[int]:
        """The engine's EngineCore processes (vLLM titles them `VLLM::EngineCore...`) in its
        process group."""
        if self.proc is None:
            return []
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    in_group = os.getpgid(int(entry.name)) == self.proc.pid
                    if in_group and b"EngineCore" in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
        return pids

    def stop_core(self) -> None:
        """SIGSTOP the EngineCore: no step runs until `resume_core`, while the API server still
        answers and streams what the core gave it before."""
        pids = self.core_pids()
        if not pids:
            raise RuntimeError(f"{self.spec.name} has no EngineCore process to stop")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

    def resume_core(self) -> None:
        for pid in self.core_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the engine and its children at once (a crash, not a shutdown)."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        self.signal_group(signal.SIGCONT)  # a core a failed test left stopped
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        self.signal_group(signal.SIGKILL)  # grandchildren of an exited leader, too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def restart(self) -> None:
        """Stopped and started again on its ports, healthy (one that stopped serving)."""
        self.stop()
        self.start()
        self.wait_healthy()


def plan_tiny_cluster(model_dir: Path, run_dir: Path, sets: list[str] | None = None) -> LocalPlan:
    """The tiny example as `tandem up --engine vllm` plans it, on this machine's cores."""
    sc = load_cluster(EXAMPLE, [f"spec.model.name={model_dir}", *(sets or [])])
    options = LocalOptions(
        engine="vllm",
        router_port=free_port(),
        vllm_python=VLLM_PYTHON,
        machine=probe_machine(VLLM_PYTHON, os.environ),
    )
    ports = PortPool()
    try:
        return build_plan(sc, options, ports.take, run_dir, os.environ)
    finally:
        ports.release()


class Router(TandemProcess):
    """`tandem router --config FILE` for a plan, with config overrides."""

    def __init__(self, config: RouterConfig, run_dir: Path, name: str = "router") -> None:
        path = run_dir / f"{name}.yaml"
        path.write_text(config.to_yaml())
        self.config = config
        super().__init__(name, ["router", "--config", str(path)], config.port)
        admin_port = config.trust.admin_port
        self.admin_url = f"http://127.0.0.1:{admin_port}" if admin_port else self.url

    def engines(self) -> list[dict[str, Any]]:
        # A router starved beside three engines on two cores has taken over 5 s to answer (CI)
        engines: list[dict[str, Any]] = httpx.get(f"{self.admin_url}/engines", timeout=60).json()
        return engines

    def wait_engines_healthy(self, dead: set[str], timeout_s: float = 30.0) -> None:
        """Until every process of the router serves and sees every engine healthy but the `dead`
        ones (URLs). The router answers as soon as one process serves; on a starved machine the
        next may start seconds later, and a test of several processes needs them all."""
        processes = self.config.processes
        every = {str(i) for i in range(processes)}

        def seen() -> bool:
            return all(
                e["healthy"] and (processes == 1 or set(e["processes"]) == every)
                for e in self.engines()
                if e["url"] not in dead
            )

        if not until(seen, timeout_s, 0.2):
            raise TimeoutError(f"router does not see every engine healthy: {self.engines()}")

    def kv_seqs(self) -> dict[str, int]:
        """The last KV-event sequence number seen of each engine (of a router of several
        processes: the lowest over them, so every process has it)."""

        def seq(view: dict[str, Any]) -> int:
            return -1 if view["kv_events_last_seq"] is None else int(view["kv_events_last_seq"])

        return {
            e["url"]: min(map(seq, e["processes"].values())) if "processes" in e else seq(e)
            for e in self.engines()
        }

    @staticmethod
    def _published(
        url: str, endpoints: dict[str, str | None], seen: dict[str, int], last: dict[str, int]
    ) -> int:
        """The newest batch engine `url` has published: its replay endpoint's last, or, for an
        engine without one, what the router has (all there is to go by). An answer cut short
        (no end marker within its bound) keeps the last full one's figure: a partial count would
        look like the engine moving and restart the wait's quiet spell."""
        endpoint = endpoints.get(url)
        if endpoint is None:
            return seen[url]
        seqs, ended = replayed(endpoint)
        return seqs[-1] if ended or url not in last else last[url]

    def wait_kv_events_settled(self, before: dict[str, int], timeout_s: float = 60.0) -> None:
        """Until the index has what the last request stored: the router has every batch each
        engine has published (the newest sequence number its replay endpoint holds) and the
        engines published nothing for half a second, which every engine's sequence moved past
        `before`, or for two seconds whatever moved (a request whose blocks were all cached
        already stores nothing, or only on the decode engine: seen with a repeated prompt in
        test_render). The engine core hands a step's events to its publisher before the step's
        outputs, so once the request is answered its batches are published or about to be;
        what the router has not received yet is waited for, however long it lags. A spell of
        quiet needs two looks to be seen, which `until` asks for."""
        static = self.config.static
        endpoints = {
            e.url: e.kv_events_replay
            for e in ([*static.prefill, *static.decode, *static.workers] if static else [])
        }
        start = time.monotonic()
        last: dict[str, int] = {}
        since = start
        # (seconds into the wait, seconds the look took, the router's, the engines') at every
        # change of either: a timeout shows which side moved when, and which look was slow
        timeline: list[tuple[float, float, dict[str, int], dict[str, int]]] = []
        looks = 0

        def settled() -> bool:
            nonlocal last, since, looks
            looked_at = time.monotonic()
            seen = self.kv_seqs()
            published = {url: self._published(url, endpoints, seen, last) for url in seen}
            looks += 1
            took = round(time.monotonic() - looked_at, 2)
            if not timeline or timeline[-1][2:] != (seen, published):
                timeline.append((round(time.monotonic() - start, 2), took, seen, published))
            if published != last:
                last, since = published, time.monotonic()
            caught_up = all(seen[url] >= seq for url, seq in published.items())
            still = time.monotonic() - since
            moved = all(seq > before.get(url, -1) for url, seq in published.items())
            return caught_up and ((moved and still > 0.5) or still > 2.0)

        if until(settled, timeout_s, 0.1):
            return
        probes = {url: replay_probe(endpoint) for url, endpoint in endpoints.items()}
        raise TimeoutError(
            f"KV events did not settle: before {before}, published {last}, router's "
            f"{self.kv_seqs()} after {looks} looks; (s, look's s, router's, published) at each "
            f"change: {timeline[-20:]}; "
            f"the engines' replay endpoints asked directly: {probes}; "
            f"router's view: {self.engines()}; router log:\n{self.output()}"
        )


def replayed(endpoint: str, timeout_s: float = 3.0) -> tuple[list[int], bool]:
    """The sequence numbers of the batches an engine's KV-event replay endpoint holds, oldest
    first, after a -1 (none yet), and whether its end marker came within `timeout_s` of the last
    answer."""
    seqs = [-1]
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(int(timeout_s * 1000)):
            frames = dealer.recv_multipart()
            if len(frames) < 4 or frames[2] == END_OF_REPLAY:
                return seqs, True
            seqs.append(int.from_bytes(frames[2], "big"))
    return seqs, False


def replay_probe(endpoint: str | None) -> str:
    """What an engine's KV-event replay endpoint answers a request for everything it buffered,
    asked from here (tells an engine that stopped publishing from a router that stopped
    listening)."""
    if endpoint is None:
        return "no replay endpoint"
    seqs, ended = replayed(endpoint)
    answer = "then the end marker" if ended else "then nothing in 3 s"
    return f"{len(seqs) - 1} batches ({seqs[1:2]} to {seqs[-1]}), {answer}"


class PDCluster:
    """The shared pair: engines started from the plan (restarted when a test killed one) and a
    router per test module's needs."""

    # every pair of the session: a test that needs the machine's room for engines of its own
    # stops the others (at most two vLLM engines at a time)
    pairs: list[PDCluster] = []

    def __init__(self, plan: LocalPlan, run_dir: Path) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.prefill, self.decode = (EngineProcess(s, run_dir) for s in plan.engines)
        self.routers: list[Router] = []
        self.checked_for = ""  # the test module `ensure_serving` last checked the engines for
        self.handshaken: tuple[int | None, int | None] | None = None  # pids of the last handoff
        PDCluster.pairs.append(self)

    def stop_others(self) -> None:
        """Stops every other pair of the session (a stopped pair restarts on its next use)."""
        for pair in PDCluster.pairs:
            if pair is not self:
                pair.stop()

    def ensure_engines(self, *needed: EngineProcess) -> None:
        """The `needed` engines (default both) healthy; a killed one is started again on its own
        ports."""
        dead = [
            e
            for e in needed or (self.prefill, self.decode)
            if not e.alive() or not e.healthy(TIER_CONNECT_S)
        ]
        for engine in dead:
            engine.stop()
            engine.start()
        for engine in dead:
            engine.wait_healthy()
        if not needed:
            self.ensure_handshake()

    def ensure_handshake(self, attempts: int = 3) -> None:
        """One handoff pulled over NIXL between the running pair before any test measures one. The
        first pull from a prefill engine starts vLLM's NIXL handshake, which gives up after 5 s
        without a reply (then the decode engine recomputes the prompt); a loaded machine has
        stalled an engine that long. Once per pair of processes."""
        pair = (self.prefill.pid, self.decode.pid)
        if pair == self.handshaken:
            return
        for attempt in range(attempts):
            prompt = f"The pair's handshake, attempt {attempt} of processes {pair}. " * 4
            before = nixl_pulls(self.decode)
            decode_directly(self.decode, prompt, prefill_directly(self.prefill, prompt))
            done, failed = (b - a for a, b in zip(before, nixl_pulls(self.decode), strict=True))
            if done >= 1 and failed == 0:
                self.handshaken = pair
                return
            print(f"handshake attempt {attempt}: pulls done {done}, failed {failed}; again")
        excerpt = failure_excerpt(self.decode.log_text(), tail_lines=60)
        raise AssertionError(f"no NIXL pull in {attempts} handoffs; the decode log:\n{excerpt}")

    def ensure_serving(self, module: str) -> None:
        """Once per test `module`: each running engine serving (`EngineProcess.serves`). One that
        stopped serving is restarted, its log's last lines kept in the run folder and reported, so
        that the cause is seen where it happened and the module does not inherit a stuck engine."""
        if module == self.checked_for:
            return
        self.checked_for = module
        for engine in (self.prefill, self.decode):
            problem = engine.serves(engine.auth) if engine.alive() else None
            if problem is None:
                continue
            kept = self.run_dir / f"{engine.spec.name}-stuck-{time.strftime('%H%M%S')}.log"
            kept.write_text(failure_excerpt(engine.log_text(), tail_lines=200))
            warnings.warn(
                f"{engine.spec.name} stopped serving before {module} ({problem}); restarted. "
                f"Its log: {kept}",
                stacklevel=2,
            )
            engine.restart()

    def router(self, name: str = "router", **changes: object) -> Router:
        """A router for the pair (the plan's config with `changes`), ready; one of several
        `processes` serves its /engines and /metrics on an admin port of its own."""
        # What this tier tests is routing over real engines, not the monitor's verdict on an engine
        # silent for 2 s (the product's connect and health timeout): CI has seen this loaded
        # machine hold an engine's API server silent for 28 s, and a router that then marks it
        # unhealthy routes around it. With the pair's one decode engine so marked a moment, a
        # request waits for it (engineWaitSeconds, as for engines that restart) instead of
        # getting the 503 of a pool with none.
        planned = self.plan.router_config
        timeouts = planned.timeouts.model_copy(update={"connect_s": TIER_CONNECT_S})
        admission = planned.admission.model_copy(update={"engine_wait_s": TIER_ENGINE_WAIT_S})
        config = planned.model_copy(
            update={
                "port": free_port(),
                "timeouts": timeouts,
                "admission": admission,
                **changes,
            }
        )
        admin_port = free_port() if config.processes > 1 else None
        # The tests read the engines' addresses.
        trust = TrustConfig(trust_all_clients=True, admin_port=admin_port)
        config = config.model_copy(update={"trust": trust})
        router = Router(config, self.run_dir, name)
        self.routers.append(router)
        router.wait_ready(timeout=60)
        router.wait_engines_healthy({e.url for e in (self.prefill, self.decode) if not e.alive()})
        return router

    def stop(self) -> None:
        for router in self.routers:
            router.stop()
        self.routers.clear()
        for engine in (self.prefill, self.decode):
            engine.stop()
