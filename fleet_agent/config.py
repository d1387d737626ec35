"""The agent's settings: `FLEET_AGENT_*` environment variables (or `fleetctl agent run` options)."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet_core.agent_defaults import DRAIN_DEADLINE_S

Backend = Literal["nvml", "dcgm", "simulated"]

log = logging.getLogger("fleet_agent")

# A token is one line of printable ASCII (fleet tokens are `flt_` + base64url); a file larger than
# this is not a token file.
_MAX_TOKEN_BYTES = 4096


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_AGENT_", extra="ignore")

    # Identity: the server this agent runs on (its inventory name) and its agent token: exactly
    # one of `token` (FLEET_AGENT_TOKEN) and `token_file` (FLEET_AGENT_TOKEN_FILE, mode 0600; a
    # new token written there is used from the next request on, no restart: TokenFile below).
    server: str = Field(min_length=1, max_length=63)
    token: SecretStr | None = None
    token_file: Path | None = Field(default=None, validate_default=True)
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
    # A deployment's `engine` picks its program: engine_command is trtllm's; vLLM's and
    # SGLang's default to their specs' (`vllm`, `python3 -m sglang.launch_server`); the stand-in
    # speaks each (`python -m fleet_agent.engine.standin.vllm` / `.sglang`).
    engine_command_vllm: str | None = None
    engine_command_sglang: str | None = None
    # Each engine's version is checked (once per command) before its first replica starts; a
    # version this agent does not drive fails the replicas with one line. Off only for tests.
    engine_check_version: bool = True
    engine_version_timeout_s: float = Field(default=60.0, gt=0)
    # Engines outlive a crashed agent (the restarted one adopts them) but stop by themselves
    # when no agent has polled them for this long: longer than an agent restart takes (seconds;
    # a slow host's boot of the agent well under a minute), shorter than GPUs should stay held
    # by engines nobody supervises. 0: engines are not leashed (they live until killed).
    engine_leash_bound_s: float = Field(default=300.0, ge=0)
    engine_base_port: int = Field(default=8100, ge=1, le=65000)
    engine_host: str = "127.0.0.1"
    work_dir: Path = Path("fleet-agent")  # engine logs and options files
    model_root: Path | None = None  # weights at MODEL_ROOT/<deployment>/<name>
    engine_load_timeout_s: float = Field(default=900.0, gt=0)
    engine_stop_grace_s: float = Field(default=30.0, gt=0)
    # The weights cache (fleet_agent/weights/, docs/weights.md): model versions the fleet
    # assigns are fetched into cache_dir (default work_dir/weights) and engines start there.
    # cache_bytes: its budget, in bytes or with a unit ("500GiB", "2T"); default 80 % of the
    # file system's size. Fetches: chunk size, per-read timeout, retry of a failed version.
    cache_dir: Path | None = None
    cache_bytes: int | None = Field(default=None, ge=0)
    fetch_chunk_bytes: int = Field(default=1 << 20, ge=64 << 10, le=256 << 20)
    fetch_timeout_s: float = Field(default=30.0, gt=0)
    fetch_retry_s: float = Field(default=30.0, gt=0)
    # s3:// artifacts: FLEET_AGENT_S3_ENDPOINT_URL, _REGION, _ACCESS_KEY_ID,
    # _SECRET_ACCESS_KEY (never logged), read by fleet_agent/weights/s3.py S3Settings.from_env
    # with the standard AWS_* names as fallback.
    # Self-drain (an unhealthy verdict or the fleet's "drain"): in-flight requests get this long
    # to finish before the engines are stopped.
    drain_deadline_s: float = Field(default=DRAIN_DEADLINE_S, ge=0)

    @field_validator("cache_bytes", mode="before")
    @classmethod
    def _byte_size(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value

    def weights_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.work_dir / "weights"

    @field_validator("token_file")
    @classmethod
    def _one_token(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        given = info.data.get("token") is not None
        if given == (value is not None):
            raise ValueError(
                "give the agent token in exactly one of FLEET_AGENT_TOKEN and"
                f" FLEET_AGENT_TOKEN_FILE ({'both are' if given else 'neither is'} set)"
            )
        if value is not None:
            # Refused now (mode, empty, unreadable) rather than at the first request.
            try:
                read_token_file(value)
            except OSError as exc:
                raise ValueError(_one_line(exc)) from None
        return value

    def bearer(self) -> Callable[[], str]:
        """The agent token, asked for before each request to the fleet."""
        if self.token_file is not None:
            return TokenFile(self.token_file)
        token = self.token.get_secret_value() if self.token is not None else ""
        return lambda: token

    @model_validator(mode="after")
    def _tls_complete(self) -> AgentSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("FLEET_AGENT_TLS_CERT and FLEET_AGENT_TLS_KEY go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("FLEET_AGENT_TLS_CLIENT_CA needs FLEET_AGENT_TLS_CERT and _KEY")
        return self


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """ "500GiB", "2 TB", "1.5g" or "1073741824" → bytes (decimal units for k/M/G/T, binary
    for KiB/MiB/GiB/TiB)."""
    raw = text.strip().lower().replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = raw[len(number) :].strip() if number else raw
    if unit not in _UNITS or not number:
        raise ValueError(f"not a byte size: {text[:40]!r} (e.g. 500GiB, 2TB, 1073741824)")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a byte size: {text[:40]!r} (e.g. 500GiB, 2TB, 1073741824)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"not a byte size: {text[:40]!r}")
    return int(value * _UNITS[unit])


class TokenFileError(ValueError):
    """The token file cannot be used (its mode, its content); one line naming the file, never
    what it holds."""


# What identifies one version of the file: a rewrite (in place or by rename) changes one of them.
_Signature = tuple[int, int, int, int]


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_token_file(path: Path) -> str:
    return _read(path)[0]


def _read(path: Path) -> tuple[str, _Signature]:
    """The token in `path` (surrounding whitespace stripped) and the signature of the file read."""
    with open(path, "rb") as file:
        st = os.fstat(file.fileno())  # the file opened, not whatever the path names by now
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"token file {path} is not a regular file")
        if st.st_mode & 0o066:
            raise TokenFileError(
                f"token file {path} is readable or writable by group or others (mode"
                f" {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}"
            )
        data = file.read(_MAX_TOKEN_BYTES + 1)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"token file {path} holds bytes that are not ASCII") from None
    if not token:
        raise TokenFileError(f"token file {path} is empty")
    if len(data) > _MAX_TOKEN_BYTES or not all(" " < c <= "~" for c in token):
        raise TokenFileError(f"token file {path} holds more than one printable token")
    return token, _signature(st)


class TokenFile:
    """The agent token from FLEET_AGENT_TOKEN_FILE, called before each request to the fleet: a
    stat of the file, and a new read only when it changed (inode, size or mtime), so a rotated
    token is used without restarting the agent (and its engines). A file that cannot be read
    keeps the token in use (said once, until a read succeeds again)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token, self._seen = _read(path)
        self._failing = False

    def __call__(self) -> str:
        try:
            if _signature(os.stat(self.path)) == self._seen:
                return self._token
            token, seen = _read(self.path)
        except (OSError, TokenFileError) as exc:
            if not self._failing:
                self._failing = True
                log.warning("agent token: %s (keeping the token in use)", _one_line(exc))
            return self._token
        if token != self._token:
            log.info("agent token: read a new token from %s", self.path)
        elif self._failing:
            log.info("agent token: %s readable again", self.path)
        self._token, self._seen, self._failing = token, seen, False
        return token


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"token file {exc.filename}: {exc.strerror or type(exc).__name__}"
    return str(exc)
