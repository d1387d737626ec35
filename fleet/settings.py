"""Service settings (`FLEET_*` environment variables) and the embedded-default data directory.

The embedded default is a SQLite file plus a generated secret key in the data directory, so a
first run needs no configuration. Any other database must come with an explicit secret key:
silently generating one next to a shared Postgres would make the BMC credentials unreadable to
every other service replica.
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

SECRET_KEY_FILE = "secret.key"
DB_FILE = "fleet.db"
# Pool connections kept for the control loops (one per loop, and the BMC workers' records):
# the API's admission never hands them out.
LOOP_CONNECTIONS = 7


def default_data_dir() -> Path:
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "fleet"


# Accepted URL schemes -> the SQLAlchemy dialect+driver we use for them.
_SCHEMES = {
    "sqlite": "sqlite",
    "postgresql+psycopg": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
}


class ConfigError(RuntimeError):
    """A setting is missing or unsafe; the message says which and what to set."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = None
    secret_key: SecretStr | None = None
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(default=8080, ge=1, le=65535)
    log_level: str = "INFO"
    # TLS (docs/api.md): `fleetctl serve` answers https with this certificate and key (both or
    # neither). Calling agents: their certificates are verified against `tls_ca_bundle` (default:
    # the system's CAs), and the client certificate and key are presented to agents that
    # require one (FLEET_AGENT_TLS_CLIENT_CA).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca_bundle: Path | None = None
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None
    # BMC calls: one request is bounded by the call timeout; transient failures (5xx, busy)
    # are retried with jittered backoff up to `bmc_attempts` in all, never past the total.
    bmc_call_timeout_s: float = Field(default=10.0, gt=0)
    bmc_total_timeout_s: float = Field(default=30.0, gt=0)
    bmc_attempts: int = Field(default=3, ge=1, le=10)
    bmc_backoff_s: float = Field(default=0.5, ge=0)
    # Bulk power actions: BMCs called at once, and the inrush stagger of power-ons per rack.
    bmc_workers: int = Field(default=32, ge=1, le=512)
    # One power action per server at a time holds a lease row (fleet/leases.py), renewed every
    # third of `lease_s` while its BMC answers; a crashed holder's server is free after it.
    lease_s: float = Field(default=30.0, ge=3, le=600)
    power_on_per_rack: int = Field(default=2, ge=1)
    power_on_rack_delay_s: float = Field(default=2.0, ge=0)
    # Once Fleet sends a power action, the reconciler leaves the server alone this long (BMCs
    # apply resets seconds late; sushy-tools 1-11 s).
    power_settle_s: float = Field(default=20.0, ge=0)
    # Rack power (docs/power.md). Measured draw: readings are kept per server and per rack in
    # buckets of `power_bucket_s` (one row per subject per bucket), server buckets for
    # `power_server_history_s`, rack buckets for `power_rack_history_s`. Measured mode commits
    # a server's p99 over `power_measured_window_s` once `power_measured_min_s` of it exists.
    power_bucket_s: float = Field(default=300.0, gt=0)
    power_server_history_s: float = Field(default=86_400.0, gt=0)
    power_rack_history_s: float = Field(default=7 * 86_400.0, gt=0)
    power_measured_window_s: float = Field(default=86_400.0, gt=0)
    power_measured_min_s: float = Field(default=3_600.0, ge=0)
    # The cap valve (fleet/power/caps.py): above `power_cap_high_pct` of a rack's budget drawn,
    # its serving GPUs are capped, step by step down to `power_cap_floor_pct` of TDP; below
    # `power_cap_low_pct` the caps are lifted again. At 100 % no new boot enters the rack.
    power_cap_high_pct: float = Field(default=90.0, gt=0, le=100)
    power_cap_low_pct: float = Field(default=80.0, gt=0, le=100)
    power_cap_floor_pct: float = Field(default=50.0, gt=0, le=100)
    power_cap_step_pct: float = Field(default=10.0, gt=0, le=50)
    # The valve's pass (fleet/power/valve.py), a leader loop: it decides a rack again only on
    # readings taken after its last change had time to reach the agents.
    power_valve_interval_s: float = Field(default=15.0, gt=0)
    # The reconciler: every server's BMC read this often; `reconcile_failures` failed reads in
    # a row mark a BMC unreachable, read then only every `reconcile_unreachable_interval_s`.
    reconcile_interval_s: float = Field(default=60.0, gt=0)
    reconcile_failures: int = Field(default=3, ge=1)
    reconcile_unreachable_interval_s: float = Field(default=300.0, gt=0)
    # Singleton loops run in the leader only, the holder of a lease (fleet/control/leader.py)
    # renewed every third of `leader_lease_s`. A leader that dies or stops (SIGKILL, SIGSTOP, a
    # paused VM) loses it after the lease; followers try again every loop tick. A clean exit
    # gives it back at once.
    leader_lease_s: float = Field(default=10.0, ge=0.3, le=300)
    # Off: this process serves the API only and never leads (e.g. in tests, or read replicas).
    run_loops: bool = True
    # A leader whose loop ticks fail `leader_step_down_failures` times in a row (all loops
    # together: any good tick resets the count) releases the lock and follows for
    # `leader_step_down_s`, so that a healthy replica takes over (fleet/control/leader.py).
    leader_step_down_failures: int = Field(default=5, ge=1)
    leader_step_down_s: float = Field(default=60.0, gt=0)
    # How this process's connections show in Postgres's pg_stat_activity (name replicas apart).
    db_application_name: str = Field(default="fleet", min_length=1, max_length=63)
    # false behind PgBouncer in transaction mode before 1.21 (Debian 12 has 1.18): server-side
    # prepared statements live on one server connection, which such a pooler changes under us.
    db_prepared_statements: bool = True
    # A database host that stops answering (a partition, a host gone) must cost a request
    # seconds, not the kernel's ~15 minutes of TCP retries: connecting (TCP, TLS, the startup
    # and authentication) is bounded by `db_connect_timeout_s` (libpq's connect_timeout: whole
    # seconds, at least 2); a connection whose sent bytes go unacknowledged for
    # `db_tcp_user_timeout_s` fails (Linux TCP_USER_TIMEOUT; 0: the kernel's own), and idle
    # pooled connections are probed with TCP keepalives (db.TCP_KEEPALIVES), so that a dead one
    # is found before a request takes it. A slow query is not cut by either: Postgres
    # acknowledges the bytes while it works.
    db_connect_timeout_s: int = Field(default=5, ge=2, le=300)
    db_tcp_user_timeout_s: float = Field(default=15.0, ge=0, le=600)
    # The database pool and the API's admission are sized together (docs/api.md): at most
    # `api_max_in_flight` API requests run at once, each holding at most one connection, and
    # the pool keeps `LOOP_CONNECTIONS` more for the control loops. A request waits up to
    # `api_admission_wait_s` for a slot, then gets 503 with Retry-After; a connection is waited
    # for `db_pool_timeout_s` at most (then 503 too), never the 30 s default. A few at once is
    # all one process can use (the GIL); more only delay its event loop, /healthz included.
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=10, ge=0)
    db_pool_timeout_s: float = Field(default=5.0, gt=0, le=60)
    api_max_in_flight: int = Field(default=8, ge=1)
    api_admission_wait_s: float = Field(default=2.0, ge=0, le=60)
    api_retry_after_s: int = Field(default=2, ge=1, le=3600)
    # SIGTERM: in-flight requests get `shutdown_grace_s`, then the loops stop; whatever still
    # hangs at `shutdown_timeout_s` after the signal, the process exits anyway.
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    shutdown_timeout_s: float = Field(default=8.0, gt=0)
    # Provisioning (fleet/provisioning/tick.py), a tick of the leader every
    # `provision_interval_s`.
    # Deadlines: large GPU servers take 10-15 min to POST (docs/hardware.md), then the GPU stack.
    provision_interval_s: float = Field(default=5.0, gt=0)
    # Between ticks the leader reads the wake-up counters this often (fleet/control/wakeups.py):
    # a spare asked to boot, an agent registered or ready wakes the provisioner from any replica.
    # 0: off (each step waits for a tick).
    wake_poll_s: float = Field(default=0.1, ge=0, le=10)
    boot_deadline_s: float = Field(default=1500.0, gt=0)
    load_deadline_s: float = Field(default=900.0, gt=0)
    # How long the fleet waits for an agent to drain before moving on without it.
    drain_deadline_s: float = Field(default=300.0, gt=0)
    # A power command without an answer (a crash after the BMC call) is asked again only after
    # this long, once the BMC has surely applied the first one (sushy: 1-11 s).
    power_retry_after_s: float = Field(default=30.0, gt=0)
    power_off_deadline_s: float = Field(default=600.0, gt=0)
    # A serving server silent this long is drained and power cycled (3 missed heartbeats
    # already take it out of routing); after a leader change, silence counts after the grace.
    heartbeat_cycle_after_s: float = Field(default=300.0, gt=0)
    leader_grace_s: float = Field(default=60.0, ge=0)
    # The same fault after this many reboots: quarantine.
    max_reboots_same_fault: int = Field(default=2, ge=0)
    # More than this share of servers turning unhealthy within the window: automatic
    # remediation stops until a person resumes it.
    breaker_share: float = Field(default=0.2, gt=0, le=1)
    breaker_window_s: float = Field(default=600.0, gt=0)
    # The autoscaler (fleet/autoscaler/): a tick of the leader, the queue-per-GPU target and
    # the windows a signal must hold before it scales (up quickly, down slowly).
    autoscale_interval_s: float = Field(default=15.0, gt=0)
    autoscale_queue_per_gpu: float = Field(default=10.0, gt=0)
    autoscale_up_window_s: float = Field(default=60.0, ge=0)
    autoscale_down_window_s: float = Field(default=600.0, ge=0)
    autoscale_cooldown_down_s: float = Field(default=300.0, ge=0)
    # A scale-in leaves the engines' batch slots (max_batch_size) at most this busy (the
    # window's peak, on one server fewer): fleet/autoscaler/policy.py, rule 6.
    autoscale_slot_ceiling: float = Field(default=0.75, gt=0, le=1)
    # Routers report their load every few seconds (fleet/router/); older reports are ignored.
    router_report_stale_s: float = Field(default=30.0, gt=0)
    # A GPU model's boot-to-ready time (power-on to serving) before any boot of it has been
    # measured (docs/hardware.md: 10–15 min of POST on large GPU servers, 3–5 more for the GPU
    # stack).
    boot_estimate_s: float = Field(default=1200.0, gt=0)
    # Measured boots are kept this long; what the autoscaler and the calendar plan with is
    # this quantile of them plus this margin (fleet/provisioning/boot_times.py).
    boot_history_days: float = Field(default=90.0, gt=0, le=3650)
    boot_quantile: float = Field(default=0.9, ge=0.5, le=1.0)
    boot_margin_pct: float = Field(default=10.0, ge=0, le=200)
    # Predictive scaling (fleet/autoscaler/forecast.py, docs/autoscaler.md): the autoscaler
    # also asks for what each deployment's seasonal demand needs one boot ahead (off: reactive
    # alone). The demand history it learns from is kept this long (its profile uses 4 weeks);
    # a forecast whose error over 6 h passes the bound stops acting until it is back under
    # 0.25 (an Event each way). The profile is fitted again this often.
    forecast: bool = True
    demand_history_days: float = Field(default=35.0, gt=0, le=3660)
    forecast_max_error: float = Field(default=0.35, gt=0.25, le=10)
    forecast_refit_s: float = Field(default=3600.0, gt=0)
    # The scheduled-scaling calendar (fleet/calendar/): a tick of the leader. An entry fires
    # one measured p90 boot-to-ready before its minute, within one tick.
    calendar_interval_s: float = Field(default=30.0, gt=0)
    # The inference-quality probe: each serving server's replicas answer a known prompt this
    # often (0: never); an answer unlike the deployment's reference drains the server.
    probe_interval_s: float = Field(default=300.0, ge=0)
    probe_prompt: str = Field(
        default="Fleet inference-quality probe: list the first five prime numbers.", max_length=2000
    )
    probe_max_tokens: int = Field(default=16, ge=1, le=256)
    # Pre-staging (fleet/provisioning/staging.py; docs/weights.md): a warm spare powered on to
    # fetch a version into its cache is given this long (power-on to verified) before it is
    # powered off again and the failure recorded.
    stage_deadline_s: float = Field(default=3600.0, gt=0)
    # Rollouts (fleet/rollout/; docs/weights.md): a tick of the leader; each step's analysis
    # window and the least canary requests a window needs before it can pass; the canary fails
    # a step when its error rate exceeds the stable version's by more than
    # `rollout_max_error_increase` (absolute), or its latency p95 or TTFT p95 exceeds the
    # stable version's × `rollout_max_latency_ratio`, or a probe of it mismatches.
    rollout_interval_s: float = Field(default=5.0, gt=0)
    rollout_step_s: float = Field(default=300.0, gt=0)
    rollout_min_requests: int = Field(default=20, ge=1)
    rollout_max_error_increase: float = Field(default=0.02, ge=0, le=1)
    rollout_max_latency_ratio: float = Field(default=1.5, ge=1)
    # Agents heartbeat this often (the fleet tells them in every reply).
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    # On Postgres, a heartbeat that changes nothing the fleet acts on is answered on the event
    # loop from what the last full one left, checked with one statement on one of
    # `heartbeat_connections` connections of its own, and its measurements written in one
    # batch every `heartbeat_batch_s` (fleet/registry/heartbeat_ingest.py). Off: every
    # heartbeat takes the full path.
    heartbeat_fast_path: bool = True
    heartbeat_connections: int = Field(default=2, ge=1, le=16)
    heartbeat_batch_s: float = Field(default=0.25, gt=0, le=5)
    # The agent URL and replica URLs an agent reports must name the address its request came
    # from, or lie in one of these networks (agents behind NAT or a proxy): CIDRs, comma-separated
    # ("10.20.0.0/16,fd00:20::/64") or a JSON list.
    agent_networks: Annotated[list[IPv4Network | IPv6Network], NoDecode] = Field(
        default_factory=list
    )
    # Redfish TLS: verified by default (optionally against a CA bundle); off only when asked.
    bmc_verify_tls: bool = True
    bmc_ca_bundle: Path | None = None
    # Paging of list endpoints: a client may ask for up to `max_page_size` rows.
    default_page_size: int = Field(default=100, ge=1)
    max_page_size: int = Field(default=1000, ge=1)
    # Request bodies (fleet/api/edge.py), refused with 413 before they are read past the limit:
    # every JSON body, and inventory files (import, validate; operators only).
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    max_inventory_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Agent tokens minted through the API (fleet/auth.py, docs/ansible.md): their lifetime, and
    # how long a rotated one keeps working after its successor is issued (the agent's settings
    # file is rewritten and the agent restarted within it).
    agent_token_lifetime_s: float = Field(default=90 * 86_400.0, gt=0, le=3650 * 86_400.0)
    agent_token_overlap_s: float = Field(default=3_600.0, ge=0)
    # SSH from the fleet to servers' OS (fleet/ssh/, docs/ansible.md): the private key (a file
    # readable by the service only; its contents and passphrase are never logged), the login,
    # the connect and per-command timeouts, and how many servers are reached at once.
    ssh_key_file: Path | None = None
    ssh_key_passphrase: SecretStr | None = None
    ssh_user: str = Field(default="root", min_length=1, max_length=64)
    ssh_connect_timeout_s: float = Field(default=10.0, gt=0, le=300)
    ssh_command_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    ssh_workers: int = Field(default=8, ge=1, le=256)
    # `fleetctl servers diagnose`: one server's whole collection is bounded in time and its
    # bundle in size (each command's output is cut at `diagnose_max_output_bytes`).
    diagnose_timeout_s: float = Field(default=180.0, gt=0, le=3600)
    diagnose_max_output_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    diagnose_max_bundle_bytes: int = Field(default=32 * 1024 * 1024, ge=4096)
    # Remediation's graceful step: a server to be rebooted is first asked over SSH
    # (`systemctl reboot`); the BMC power cycle follows only if its agent has not registered
    # again within `ssh_reboot_deadline_s` (or the SSH request failed). As long as a whole
    # boot may take (the boot deadline's default): a GPU server's shutdown, POST and GPU
    # stack take 10-25 minutes, and a cycle mid-boot is the double reboot this step avoids.
    remediation_ssh_reboot: bool = False
    ssh_reboot_deadline_s: float = Field(default=1500.0, gt=0)

    @field_validator("database_url")
    @classmethod
    def _known_driver(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in _SCHEMES:
            raise ValueError(
                "FLEET_DATABASE_URL must be sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
            )
        # SQLAlchemy would pick psycopg2 for a bare postgresql:// URL; we ship psycopg 3.
        return f"{_SCHEMES[scheme]}://{rest}"

    @model_validator(mode="after")
    def _capacity(self) -> Settings:
        pool = self.db_pool_size + self.db_max_overflow
        if pool <= LOOP_CONNECTIONS:
            raise ValueError(
                f"FLEET_DB_POOL_SIZE + FLEET_DB_MAX_OVERFLOW must exceed {LOOP_CONNECTIONS} "
                "(the connections kept for the control loops)"
            )
        if self.api_max_in_flight > pool - LOOP_CONNECTIONS:
            raise ValueError(
                f"FLEET_API_MAX_IN_FLIGHT must be at most FLEET_DB_POOL_SIZE + "
                f"FLEET_DB_MAX_OVERFLOW - {LOOP_CONNECTIONS} = {pool - LOOP_CONNECTIONS}: each "
                "request may hold a connection, and the control loops keep theirs"
            )
        if self.shutdown_timeout_s <= self.shutdown_grace_s:
            raise ValueError("FLEET_SHUTDOWN_TIMEOUT_S must exceed FLEET_SHUTDOWN_GRACE_S")
        if self.power_cap_low_pct >= self.power_cap_high_pct:
            raise ValueError("FLEET_POWER_CAP_LOW_PCT must be below FLEET_POWER_CAP_HIGH_PCT")
        return self

    @model_validator(mode="after")
    def _tls_pairs(self) -> Settings:
        for cert, key in (("tls_cert", "tls_key"), ("tls_client_cert", "tls_client_key")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"FLEET_{cert.upper()} and FLEET_{key.upper()} go together")
        return self

    @field_validator("agent_networks", mode="before")
    @classmethod
    def _cidr_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if isinstance(value, list):
            # ip_network's own message ("10.0.0.1/8 has host bits set") says what to fix.
            return [ip_network(str(v).strip()) for v in value if str(v).strip()]
        return value

    @property
    def is_embedded(self) -> bool:
        """True when running on the embedded default (SQLite in the data directory)."""
        return self.database_url is None

    @property
    def effective_database_url(self) -> str:
        if self.database_url is not None:
            return self.database_url
        return f"sqlite:///{self.data_dir / DB_FILE}"

    def resolve_secret_key(self) -> bytes:
        """The Fernet key for BMC credentials; generated once for the embedded default."""
        if self.secret_key is not None:
            return self.secret_key.get_secret_value().encode()
        if not self.is_embedded:
            raise ConfigError(
                "FLEET_SECRET_KEY is required with a non-default database "
                "(generate one with `fleetctl secret-key` and give it to every service replica)"
            )
        return _embedded_secret_key(self.data_dir)


def _embedded_secret_key(data_dir: Path) -> bytes:
    from cryptography.fernet import Fernet

    path = data_dir / SECRET_KEY_FILE
    if path.exists():
        return path.read_bytes().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = Fernet.generate_key()
    # O_EXCL + 0600: never widen permissions, and never race another process into two keys.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as handle:
        handle.write(key + b"\n")
    print(
        f"fleet: generated a new secret key for BMC credentials at {path} (mode 0600)",
        file=sys.stderr,
    )
    return key


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
