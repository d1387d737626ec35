"""The router's settings: `FLEET_ROUTER_*` environment variables (or `fleetctl router run`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet.router.strategy import DEFAULT_STRATEGY, PREFILL_WEIGHT, STRATEGIES


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_ROUTER_", extra="ignore")

    # Where the routing table comes from (GET /api/v1/routing; a viewer token is enough for it,
    # a router token also reads the client keys and reports load).
    fleet_url: str = Field(default="http://127.0.0.1:8080", pattern=r"^https?://\S+$")
    token: SecretStr | None = None
    # Or a routing table in a file (JSON or YAML: the `results` of GET /api/v1/routing), re-read
    # every fleet_poll_s: a router without the fleet service (benchmarks, a static setup).
    table_file: Path | None = None
    # Who may call (docs/router.md, "Callers"): `keys` — a client key (`Authorization: Bearer
    # fk_…`) from the fleet's GET /api/v1/routing/callers (a router token), or from
    # `callers_file` with a table file; `none` — no authentication, every request is tenant
    # "anonymous" with no limits. Per-minute limits are enforced over `rate_window_s`.
    client_auth: Literal["keys", "none"] = "keys"
    callers_file: Path | None = None
    rate_window_s: float = Field(default=60.0, gt=0, le=3600)
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port (tests)
    # TLS (docs/router.md): serve https with this certificate and key. The fleet, agents and
    # https engines are verified against `ca_bundle` (default: the system's CAs); the client
    # certificate and key go to agents that require one (FLEET_AGENT_TLS_CLIENT_CA).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    ca_bundle: Path | None = None
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None
    # Router processes sharing the port (SO_REUSEPORT; the kernel spreads connections). Each
    # keeps its own books, as several routers would: see docs/router.md.
    workers: int = Field(default=1, ge=1, le=64)
    # The worker view: the routing table this often, every listed agent's /state this often.
    fleet_poll_s: float = Field(default=2.0, gt=0)
    agent_poll_s: float = Field(default=0.25, gt=0)
    agent_timeout_s: float = Field(default=0.5, gt=0)
    # Strategies: the default, and per deployment ({"llama-8b": "least_pending"}).
    strategy: str = DEFAULT_STRATEGY
    strategies: dict[str, str] = Field(default_factory=dict)
    prefill_weight: float = Field(default=PREFILL_WEIGHT, ge=0)
    # Requests in flight per replica through this router at most: the deployment's engine
    # max_batch_size when it sets one, else this. Beyond it requests wait in the router's queue.
    replica_limit: int = Field(default=64, ge=1)
    # The waiting room per deployment: beyond `queue_bound` → 429 with Retry-After; a request
    # that waits longer than `queue_timeout_s` → 503 with Retry-After. The bound must hold a
    # burst's backlog (the Azure code trace at 80 % load piles up ~530 waiting requests in
    # 1 s: docs/router.md); the timeout is what turns away real overload.
    queue_bound: int = Field(default=2048, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    # Connect errors and 503s before the first byte go to another replica (this many tries in
    # all); a replica failing `eject_after` times in a row gets nothing for `eject_s`.
    attempts: int = Field(default=3, ge=1, le=10)
    eject_after: int = Field(default=3, ge=1)
    eject_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=900.0, gt=0)  # a whole generation, at most
    # Load reports to the fleet (requests waiting, client-side p95s): autoscaler signals. They
    # need a router token (`fleetctl token create --role router`); 0 turns them off.
    report_s: float = Field(default=5.0, ge=0)
    # The request's class reaches engines that schedule by priority as their own field
    # (vLLM's and SGLang's `priority`; fleet/router/priority.py). Off: bodies pass as sent
    # (benchmarks' "without" arm; an engine started without its priority scheduling).
    pass_priority: bool = True
    log_level: str = "INFO"

    @field_validator("strategy")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in STRATEGIES:
            raise ValueError(f"unknown routing strategy {value!r} (one of {', '.join(STRATEGIES)})")
        return value

    @field_validator("strategies")
    @classmethod
    def _all_known(cls, value: dict[str, str]) -> dict[str, str]:
        for deployment, name in value.items():
            if name not in STRATEGIES:
                raise ValueError(
                    f"{deployment}: unknown routing strategy {name!r} "
                    f"(one of {', '.join(STRATEGIES)})"
                )
        return value

    @model_validator(mode="after")
    def _tls_pairs(self) -> RouterSettings:
        for cert, key in (("tls_cert", "tls_key"), ("tls_client_cert", "tls_client_key")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(
                    f"FLEET_ROUTER_{cert.upper()} and FLEET_ROUTER_{key.upper()} go together"
                )
        return self

    @model_validator(mode="after")
    def _callers_source(self) -> RouterSettings:
        if self.client_auth == "keys" and self.table_file is not None and not self.callers_file:
            raise ValueError(
                "FLEET_ROUTER_CLIENT_AUTH=keys with a table file needs FLEET_ROUTER_CALLERS_FILE "
                "(the client keys), or FLEET_ROUTER_CLIENT_AUTH=none"
            )
        return self

    def strategy_for(self, deployment: str) -> str:
        return self.strategies.get(deployment, self.strategy)
