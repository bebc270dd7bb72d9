"""The router's view of one engine: where it is, its roles, health and load (router + scraped)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.roles import Role
from tandem.router.lora import LoraSlots


@dataclass(eq=False)
class Engine:
    """One vLLM-compatible engine. `id` is its base URL, which is unique in a pool."""

    url: str
    roles: frozenset[str]
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # The NIXL side-channel port its KV handoffs must name (VLLM_NIXL_SIDE_CHANNEL_PORT).
    side_channel_port: int = 5600
    healthy: bool = True
    # Refused a request as vLLM does while it drains after SIGTERM: no new request goes to it,
    # though /health still answers 200, until a failed health check (its exit) clears it.
    draining: bool = False
    # Requests the router has open on this engine right now.
    in_flight: int = 0
    # Of those, requests whose first byte has not come back yet.
    pending: int = 0
    # When a chunk of a decode stream from it last reached this router (perf_counter): an engine
    # streaming now is alive, however long its /health takes to answer.
    heard_at: float = float("-inf")
    # Scraped from the engine's /metrics (vllm:num_requests_waiting / _running / kv_cache_usage_perc).
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    # Its KV cache in tokens (vllm:cache_config_info: num_gpu_blocks · block_size); 0: unknown.
    kv_capacity: float = 0.0
    # This router's own pending and decoding counts when `waiting`/`running` were scraped.
    pending_at_scrape: int = 0
    decoding_at_scrape: int = 0
    consecutive_failures: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    # LoRA: vllm:lora_requests_info as last scraped (None: the engine reports no LoRA), the
    # adapters its /v1/models lists (name -> path; None: not read yet) and this router's open
    # requests per adapter on it.
    lora: LoraSlots | None = None
    adapters: dict[str, str] | None = None
    adapter_streams: dict[str, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.url

    def load(self, running_weight: float = 0.25) -> float:
        """Requests ahead of a new request's first token on this engine:

            load = queued() + running_weight * streams()

        A request that is already decoding delays a new one's first token far less than a
        queued prefill under continuous batching, hence `running_weight` (config
        `runningWeight`).
        """
        return self.queued() + running_weight * self.streams()

    def queued(self) -> float:
        """Requests before their first token: max(pending, waiting + pending - pending_at_scrape).

        `pending` are the router's requests that have not had their first byte back yet (queued
        or prefilling), `waiting` the engine's scraped `vllm:num_requests_waiting` and
        `pending_at_scrape` this router's own count when it was scraped. The router's counts are
        live but miss other router replicas; the engine's are complete but up to one scrape
        interval old. So: the engine's figure brought forward by what this router has added or
        finished since, never less than the router's own live count (for a single router that is
        its exact count).
        """
        pending = self.pending
        queued = self.waiting + (pending - self.pending_at_scrape)
        return queued if queued > pending else pending

    def streams(self) -> float:
        """Requests decoding: max(decoding, running + decoding - decoding_at_scrape), with
        `decoding = in_flight - pending` and `running` the scraped `vllm:num_requests_running`,
        brought forward as in `queued`."""
        decoding = self.in_flight - self.pending
        busy = self.running + (decoding - self.decoding_at_scrape)
        return busy if busy > decoding else decoding

    def active_adapters(self) -> frozenset[str]:
        """Adapters running on the engine: those its last scrape showed running, and those of
        this router's requests open on it now (the scrape is up to one interval old)."""
        scraped = self.lora.running if self.lora is not None else frozenset()
        live = [name for name, count in self.adapter_streams.items() if count > 0]
        return scraped.union(live) if live else scraped

    def serves_model(self, adapter: str | None) -> bool:
        """Whether a request for `adapter` (None: the base model) can go here: the base model
        always; an adapter unless the engine's /v1/models was read and lacks it."""
        return adapter is None or self.adapters is None or adapter in self.adapters

    def serves(self, role: Role) -> bool:
        return role in self.roles

    @property
    def colocated(self) -> bool:
        return "prefill" in self.roles and "decode" in self.roles

    @property
    def prefill_only(self) -> bool:
        return self.roles == {"prefill"}


class EnginePool:
    """All known engines, keyed by URL; discovery adds and removes, the proxy reads."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.generation = 0  # bumped on every membership change

    def upsert(self, engine: Engine) -> Engine:
        current = self.engines.get(engine.url)
        if current is None:
            self.engines[engine.url] = engine
            self.generation += 1
            return engine
        if current.roles != engine.roles or current.kv_events != engine.kv_events:
            current.roles = engine.roles
            current.kv_events = engine.kv_events
            current.kv_events_replay = engine.kv_events_replay
            self.generation += 1
        current.side_channel_port = engine.side_channel_port
        return current

    def remove(self, url: str) -> Engine | None:
        engine = self.engines.pop(url, None)
        if engine is not None:
            engine.healthy = False
            self.generation += 1
        return engine

    def candidates(self, role: Role) -> list[Engine]:
        return [
            e for e in self.engines.values() if e.healthy and not e.draining and role in e.roles
        ]

    def all(self, role: Role | None = None) -> list[Engine]:
        return [e for e in self.engines.values() if role is None or role in e.roles]
