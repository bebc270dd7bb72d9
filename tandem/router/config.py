"""The router's configuration file: one model shared by `tandem router`, the operator and `tandem up`;
and the gateway's (`GatewayConfig`): several models' router configs behind one endpoint.

The operator renders this model into the router's ConfigMap (`router.yaml`); `tandem up` builds it
directly; the router loads it with `RouterConfig.from_yaml_file`. It lives with the router because
the data path must never import control-plane code; its policy parts (scoring, disaggregation,
admission, timeouts) are `tandem.common.routing`'s, which a ServingCluster carries unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.common.routing import (
    AdmissionConfig,
    DisaggregationConfig,
    ScoringConfig,
    TimeoutConfig,
)
from tandem.common.tenancy import TenancyConfig
from tandem.router.epp.config import EppConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class HttpLimits(_Strict):
    """Limits on client connections (docs/reliability.md compares them with nginx's and Envoy's).

    Header and body times run from the first byte of the request head or body to its last byte;
    the idle time is a keep-alive connection's wait for its next request.
    """

    header_timeout_s: float = Field(10.0, gt=0, alias="headerTimeoutSeconds")
    body_timeout_s: float = Field(30.0, gt=0, alias="bodyTimeoutSeconds")
    idle_timeout_s: float = Field(60.0, gt=0, alias="idleTimeoutSeconds")
    max_connections: int = Field(4096, ge=1, alias="maxConnections")
    max_header_count: int = Field(100, ge=1, alias="maxHeaderCount")
    # Request line plus every header name and value.
    max_header_bytes: int = Field(64 * 1024, ge=1024, alias="maxHeaderBytes")


class TrustConfig(_Strict):
    """Which clients may steer the router (priority, debug headers) and read its internals.

    A trusted client sends one of `admin_keys` as its bearer token, or every client is trusted
    (`trust_all_clients`, for a private deployment). `/engines` and `/metrics` are served on
    `admin_port` when set (and then only there); otherwise on the main port to trusted or loopback
    clients.
    """

    admin_keys: list[str] = Field(default_factory=list, alias="adminKeys")
    trust_all_clients: bool = Field(False, alias="trustAllClients")
    admin_port: int | None = Field(None, ge=0, alias="adminPort")


class KubernetesDiscovery(_Strict):
    """Discover engine pods by watching Pods with the ServingCluster's labels.

    A Pod counts only if its controller is a ReplicaSet of the pool's own Deployment
    (`<clusterName>-prefill` / `-decode`), checked by uid; the labels alone select, never admit.
    """

    namespace: str
    cluster_name: str = Field(alias="clusterName")
    engine_port: int = Field(8000, alias="enginePort")
    kv_events_port: int | None = Field(5557, alias="kvEventsPort")
    kv_events_replay_port: int | None = Field(5558, alias="kvEventsReplayPort")
    # VLLM_NIXL_SIDE_CHANNEL_PORT of the engines: a prefill answer must name it.
    side_channel_port: int = Field(5600, alias="sideChannelPort")


class StaticEndpoint(_Strict):
    """One engine given by URL; its KV events endpoints are optional."""

    url: str
    kv_events: str | None = Field(None, alias="kvEvents")  # e.g. tcp://127.0.0.1:5557
    kv_events_replay: str | None = Field(None, alias="kvEventsReplay")
    # The engine's VLLM_NIXL_SIDE_CHANNEL_PORT (vLLM's default 5600 when unset).
    side_channel_port: int | None = Field(None, alias="sideChannelPort")

    @field_validator("url")
    @classmethod
    def _engine_url(cls, url: str) -> str:
        """http(s)://HOST[:PORT][/PATH]: refused here rather than on every request."""
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ValueError(
                f"engine URL {url!r} is not http(s)://HOST[:PORT] (KV events go in kvEvents, "
                "or `--kv-events URL=tcp://HOST:PORT`)"
            )
        return url


class StaticDiscovery(_Strict):
    """Fixed engine lists, as the peer routers take them (`--prefill URL --decode URL`)."""

    prefill: list[StaticEndpoint] = Field(default_factory=list)
    decode: list[StaticEndpoint] = Field(default_factory=list)
    # Engines serving both roles (colocated, no P/D handoff).
    workers: list[StaticEndpoint] = Field(default_factory=list)


class AuthConfig(_Strict):
    """Files holding API keys (mounted Secrets in a pod), re-read when they change."""

    # Keys clients may present as `Authorization: Bearer KEY`, one per line; with `apiKeys`.
    client_keys_file: str | None = Field(None, alias="clientKeysFile")
    # The key sent to every engine as `Authorization: Bearer KEY` (the engines' --api-key).
    engine_key_file: str | None = Field(None, alias="engineKeyFile")
    # The same key given inline (`tandem up`, whose config file is private to its run directory).
    engine_key: str | None = Field(None, alias="engineKey")


class RouterConfig(_Strict):
    """Everything `tandem router` needs to serve one ServingCluster."""

    host: str = "0.0.0.0"
    port: int = 8000
    # Router processes sharing `port` (SO_REUSEPORT): each is a whole router (index, KV-event
    # subscribers, engine monitor) and the kernel spreads connections over them; a supervisor
    # restarts any that dies and serves the admin port with their metrics merged.
    processes: int = Field(1, ge=1, le=64)
    served_model_name: str = Field(alias="servedModelName")
    # Path or HF-format directory with tokenizer.json; None uses the documented approximation.
    tokenizer: str | None = None
    # The engines' `--chat-template` (a file or the template text), when they override the model's.
    chat_template: str | None = Field(None, alias="chatTemplate")
    # The engines' `--default-chat-template-kwargs`.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, alias="chatTemplateKwargs")
    # vLLM's renderer (`vllm launch render MODEL`, or an engine): "local" renders in the router
    # and asks it only for requests the router cannot tokenize exactly; "remote" asks it always.
    render_url: str | None = Field(None, alias="renderUrl")
    render_mode: Literal["local", "remote"] = Field("local", alias="renderMode")
    # Blocks of a request sent to an engine count as cached there for this long, or until the
    # engine's KV events confirm them (see index.py).
    pending_ttl_s: float = Field(10.0, ge=0, alias="pendingBlockSeconds")
    block_size: int = Field(16, ge=1, alias="blockSize")
    hash_algo: Literal["sha256", "sha256_cbor"] = Field("sha256_cbor", alias="hashAlgo")
    hash_seed: str | None = Field("0", alias="hashSeed")  # the engines' PYTHONHASHSEED
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    http: HttpLimits = Field(default_factory=HttpLimits)
    trust: TrustConfig = Field(default_factory=TrustConfig)
    kubernetes: KubernetesDiscovery | None = None
    static: StaticDiscovery | None = None
    metrics_scrape_interval_s: float = Field(0.5, gt=0, alias="metricsScrapeIntervalSeconds")
    health_check_interval_s: float = Field(2.0, gt=0, alias="healthCheckIntervalSeconds")
    # Memory bound of the prefix index: blocks remembered per engine (least recently stored
    # forgotten first); also bounds the approximate index built from routing history.
    index_max_blocks_per_engine: int = Field(262144, ge=16, alias="indexMaxBlocksPerEngine")
    # Subscribe to engines' KV events (exact index); off = approximate index from routing history.
    kv_events: bool = Field(True, alias="kvEvents")
    # Start-up waits this long at most, before serving, for discovery's first listing and each
    # engine's first KV-event replay: a router that served at once would take its first requests
    # for cold prefixes that the engines already hold.
    catch_up_s: float = Field(15.0, ge=0, alias="catchUpSeconds")
    log_level: str = Field("info", alias="logLevel")
    api_keys: list[str] = Field(default_factory=list, alias="apiKeys")
    auth: AuthConfig = Field(default_factory=AuthConfig)
    # The endpoint picker of a Gateway API inference gateway (Envoy ext_proc); off when None.
    epp: EppConfig | None = None

    @model_validator(mode="after")
    def _one_discovery(self) -> RouterConfig:
        if (self.kubernetes is None) == (self.static is None):
            raise ValueError("set exactly one of `kubernetes` and `static` discovery")
        return self

    @model_validator(mode="after")
    def _processes_admin_port(self) -> RouterConfig:
        # The supervisor serves the workers' merged metrics there; without it /metrics would be
        # one arbitrary process's, on the main port.
        if self.processes > 1 and self.trust.admin_port is None:
            raise ValueError("processes > 1 needs trust.adminPort (the merged /metrics)")
        return self

    @classmethod
    def from_yaml_file(cls, path: str | Path) -> RouterConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False
        )


class GatewayConfig(_Strict):
    """Everything `tandem gateway` needs: where it listens, whom it trusts, and one `RouterConfig`
    per model (each with its own discovery, index, scoring, admission queue, tenancy and keys).

    The gateway's `host`, `port`, `http` and `trust` replace those of every model's config; a
    model keeps its client keys (a key opens only the models that accept it), its engine key and
    its tenants.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    http: HttpLimits = Field(default_factory=HttpLimits)
    trust: TrustConfig = Field(default_factory=TrustConfig)
    log_level: str = Field("info", alias="logLevel")
    models: list[RouterConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct_names(self) -> GatewayConfig:
        names = [m.served_model_name for m in self.models]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"served model names repeated: {', '.join(repeated)}")
        return self

    def router_config(self, model: RouterConfig) -> RouterConfig:
        """`model` as one router of the gateway: the gateway's address and trust, no port or
        admin port of its own, one process."""
        return model.model_copy(
            update={
                "host": self.host,
                "port": self.port,
                "processes": 1,
                "http": self.http,
                "trust": self.trust.model_copy(update={"admin_port": None}),
            }
        )

    @classmethod
    def from_yaml_file(cls, path: str | Path) -> GatewayConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False
        )
