"""Start an agent: pick the telemetry backend, open the local API, tick until stopped."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from pathlib import Path
from types import FrameType

from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent, XidSource
from fleet_agent.engine.supervisor import EngineSupervisor, SupervisorConfig
from fleet_agent.fleet_client import FleetClient
from fleet_agent.local_api import LocalApi
from fleet_agent.telemetry import sim_gpu_state
from fleet_agent.weights.cache import WeightsCache
from fleet_agent.weights.stager import Stager
from fleet_core.gpus import GPUS
from fleet_core.telemetry import GpuTelemetry, TelemetryUnavailable

log = logging.getLogger("fleet_agent")


def sim_gpu_state_dir(settings: AgentSettings) -> Path:
    """Where the simulated GPUs and the stand-in engines on them share limits and power."""
    return settings.work_dir / "simulated-gpus"


def build_telemetry(settings: AgentSettings) -> GpuTelemetry:
    """The configured backend; TelemetryUnavailable (a clear refusal) if it cannot run here."""
    if settings.telemetry == "nvml":
        from fleet_agent.telemetry.nvml import NvmlTelemetry

        return NvmlTelemetry()
    if settings.telemetry == "dcgm":
        from fleet_agent.telemetry.dcgm import DcgmTelemetry

        return DcgmTelemetry(settings.dcgm_url)
    from fleet_agent.telemetry.simulated import SimulatedTelemetry

    log.warning(
        "telemetry: SIMULATED GPUs (%d x %s) - a stand-in for hosts without GPUs",
        settings.sim_gpus,
        settings.sim_gpu_model,
    )
    return SimulatedTelemetry(
        settings.sim_gpu_model,
        settings.sim_gpus,
        fault_file=settings.sim_fault_file,
        seed=settings.sim_seed,
        state_dir=sim_gpu_state_dir(settings),
    )


def build_kernel_log(settings: AgentSettings) -> XidSource | None:
    """Kernel-log Xids for the real backends (the simulated one has no kernel to read)."""
    if settings.telemetry == "simulated" or not settings.kernel_log:
        return None
    from fleet_agent.telemetry.kmsg import KmsgReader

    try:
        return KmsgReader()
    except TelemetryUnavailable as exc:
        log.warning("kernel log Xids off: %s", exc)
        return None


def build_supervisor(settings: AgentSettings) -> EngineSupervisor:
    config = SupervisorConfig(
        work_dir=settings.work_dir / "engines",
        engine_command=tuple(shlex.split(settings.engine_command)),
        engine_commands={
            engine: tuple(shlex.split(command))
            for engine, command in (
                ("vllm", settings.engine_command_vllm),
                ("sglang", settings.engine_command_sglang),
            )
            if command
        },
        check_versions=settings.engine_check_version,
        version_timeout_s=settings.engine_version_timeout_s,
        leash_bound_s=settings.engine_leash_bound_s or None,  # 0: no leash
        host=settings.engine_host,
        base_port=settings.engine_base_port,
        load_timeout_s=settings.engine_load_timeout_s,
        stop_grace_s=settings.engine_stop_grace_s,
        model_root=settings.model_root,
        extra_env=_simulated_engine_env(settings),
        external_env=_external_weights_env(settings),
    )
    return EngineSupervisor(config)


def _external_weights_env(settings: AgentSettings) -> dict[str, str]:
    """The STAND-IN refuses a checkpoint directory that does not exist, as trtllm-serve
    would; weights Fleet does not fetch (external versions) are delivered by nobody on a host
    without GPUs, so there it serves without them."""
    commands = (
        settings.engine_command,
        settings.engine_command_vllm or "",
        settings.engine_command_sglang or "",
    )
    if not any("fleet_agent.engine.standin" in command for command in commands):
        return {}
    return {"FLEET_STANDIN_MISSING_WEIGHTS": "ignore"}


def build_cache(settings: AgentSettings) -> WeightsCache:
    """The weights cache at cache_dir (default work_dir/weights), its budget cache_bytes
    (default 80 % of the file system's size), s3:// from FLEET_AGENT_S3_* (or AWS_*)."""
    from fleet_agent.weights.s3 import S3Settings

    root = settings.weights_dir()
    root.mkdir(parents=True, exist_ok=True)
    budget = settings.cache_bytes
    if budget is None:
        st = os.statvfs(root)
        budget = int(st.f_blocks * st.f_frsize * 0.8)
    try:
        s3 = S3Settings.from_env()
    except ValueError as exc:  # pydantic's ValidationError included: names the field only
        log.error("s3:// weights off: the S3 settings are not valid: %s", _first_line(exc))
        s3 = None
    return WeightsCache(
        root,
        budget,
        s3=s3,
        chunk_bytes=settings.fetch_chunk_bytes,
        timeout_s=settings.fetch_timeout_s,
    )


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _simulated_engine_env(settings: AgentSettings) -> dict[str, str]:
    """With simulated GPUs the engines are stand-ins: they run "on" those GPUs (their model, their
    power limits) and report back what they draw (fleet_agent/telemetry/sim_gpu_state.py)."""
    if settings.telemetry != "simulated":
        return {}
    env = {sim_gpu_state.ENV: str(sim_gpu_state_dir(settings).resolve())}
    if not os.environ.get("FLEET_STANDIN_GPU") and settings.sim_gpu_model.upper() in GPUS:
        env["FLEET_STANDIN_GPU"] = settings.sim_gpu_model.upper()
    return env


def run(settings: AgentSettings, stop: threading.Event | None = None) -> None:
    """Run until `stop` is set (or SIGTERM/SIGINT in the main thread)."""
    stop = stop or threading.Event()
    telemetry = build_telemetry(settings)
    client = FleetClient(
        settings.fleet_url,
        settings.bearer(),
        settings.request_timeout_s,
        ca_bundle=settings.ca_bundle,
    )
    agent = Agent(
        settings,
        telemetry,
        client,
        kernel_log=build_kernel_log(settings),
        supervisor=build_supervisor(settings),
        cache=(cache := build_cache(settings)),
        stager=Stager(cache, retry_s=settings.fetch_retry_s),
    )
    api = LocalApi(
        agent,
        settings.listen_host,
        settings.listen_port,
        tls_cert=settings.tls_cert,
        tls_key=settings.tls_key,
        client_ca=settings.tls_client_ca,
    )
    agent.advertise_url = settings.advertise_url or api.url
    if threading.current_thread() is threading.main_thread():

        def _stop(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    api.start()
    log.info(
        "agent for %s: local API at %s, fleet at %s, telemetry %s",
        settings.server,
        api.url,
        settings.fleet_url,
        telemetry.name,
    )
    try:
        agent.run(stop)
    finally:
        api.stop()
        client.close()
        telemetry.close()
