"""The gateway's configuration file: one endpoint, several models' router configs behind it."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, model_validator

from tandem.common.tenancy import TenancyConfig
from tandem.router.config import AuthConfig, HttpLimits, RouterConfig, TrustConfig, _Strict


class GatewayConfig(_Strict):
    """Everything `tandem gateway` needs: where it listens, who its clients are, and one
    `RouterConfig` per model (each with its own discovery, index, scoring and admission queue).

    The gateway's own `host`, `port`, `http`, `trust`, client keys and `tenancy` replace those of
    every model's config; a model keeps its engine key.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    http: HttpLimits = Field(default_factory=HttpLimits)
    trust: TrustConfig = Field(default_factory=TrustConfig)
    api_keys: list[str] = Field(default_factory=list, alias="apiKeys")
    # Keys clients may present, one per line (a mounted Secret); with `apiKeys`.
    client_keys_file: str | None = Field(None, alias="clientKeysFile")
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig)
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
        """`model` as one router of the gateway: the gateway's clients, trust and tenancy; no
        port or admin port of its own, one process."""
        auth = AuthConfig.model_validate(
            {**model.auth.model_dump(), "client_keys_file": self.client_keys_file}
        )
        trust = self.trust.model_copy(update={"admin_port": None})
        return model.model_copy(
            update={
                "host": self.host,
                "port": self.port,
                "processes": 1,
                "http": self.http,
                "trust": trust,
                "api_keys": list(self.api_keys),
                "auth": auth,
                "tenancy": self.tenancy,
            }
        )

    @classmethod
    def from_yaml_file(cls, path: str | Path) -> GatewayConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False
        )
