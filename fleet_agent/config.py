"""The agent's settings: `FLEET_AGENT_*` environment variables (or `fleetctl agent run` options)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet_core.agent_defaults import DRAIN_DEADLINE_S

Backend = Literal["nvml", "dcgm", "simulated"]


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_AGENT_", extra="ignore")

    # Identity: the server this agent runs on (its inventory name) and its agent token.
    server: str = Field(min_length=1, max_length=63)
    token: SecretStr
    fleet_url: str = Field(default="http://127.0.0.1:8080", pattern=r"^https?://\S+$")
    # The agent's own HTTP API (/healthz, /readyz, /state, /metrics): routers read it.
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(default=9410, ge=0, le=65535)  # 0: any free port (tests)
    # The URL the fleet and routers use to reach this agent (default: http(s)://host:port).
    advertise_url: str | None = Field(default=None, pattern=r"^https?://\S+$")
    # TLS (docs/agent.md): the local API answers https with this certificate and key; with
    # `tls_client_ca` it also requires a client certificate signed by that CA (the fleet's and
    # the routers'). The fleet's own certificate is verified against `ca_bundle` (default: the
    # system's CAs).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    ca_bundle: Path | None = None
    # The bearer key the local API asks of callers of /probe and /faults (reads stay open); the
    # agent sends it to the fleet at registration. Unset: a random one per start.
    api_key: SecretStr | None = Field(default=None, min_length=16, max_length=256)
    telemetry: Backend = "nvml"
    dcgm_url: str = "http://127.0.0.1:9400/metrics"
    # Kernel log Xids complement NVML and DCGM (a GPU that fell off the bus, Xids from before
    # the agent started); off where /dev/kmsg cannot be read (the agent says so once).
    kernel_log: bool = True
    # Simulated telemetry (a STAND-IN, for hosts without GPUs): model, count, fault file.
    sim_gpu_model: str = "H100"
    sim_gpus: int = Field(default=8, ge=1, le=64)
    sim_fault_file: Path | None = None
    sim_seed: int = 0
    # GPUs the inventory says this server has (the fleet's answer to registration fills it).
    expected_gpus: int | None = Field(default=None, ge=1, le=64)
    # Heartbeats: the fleet's reply sets the interval; this is the first one.
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=5.0, gt=0)
    # Reaching the fleet after a failure: exponential backoff with jitter, capped.
    backoff_initial_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    # Telemetry history the fault policy sees (its window is 10 minutes).
    history_s: float = Field(default=900.0, gt=0)
    # GPUs are read (and the verdict re-judged) this often; heartbeats go at the fleet's
    # interval, or at once when the verdict, readiness or drain state changes.
    sample_interval_s: float = Field(default=1.0, gt=0)
    # Engines (fleet_agent/engine/supervisor.py): one per replica of the assigned deployment. The
    # command is `trtllm-serve` on GPU hosts; hosts without GPUs run the STAND-IN
    # (`python -m fleet_agent.engine.standin`) with the same command line.
    engine_command: str = "trtllm-serve"
    engine_base_port: int = Field(default=8100, ge=1, le=65000)
    engine_host: str = "127.0.0.1"
    work_dir: Path = Path("fleet-agent")  # engine logs and options files
    model_root: Path | None = None  # weights at MODEL_ROOT/<deployment>/<name>
    engine_load_timeout_s: float = Field(default=900.0, gt=0)
    engine_stop_grace_s: float = Field(default=30.0, gt=0)
    # Self-drain (an unhealthy verdict or the fleet's "drain"): in-flight requests get this long
    # to finish before the engines are stopped.
    drain_deadline_s: float = Field(default=DRAIN_DEADLINE_S, ge=0)

    @model_validator(mode="after")
    def _tls_complete(self) -> AgentSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("FLEET_AGENT_TLS_CERT and FLEET_AGENT_TLS_KEY go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("FLEET_AGENT_TLS_CLIENT_CA needs FLEET_AGENT_TLS_CERT and _KEY")
        return self
