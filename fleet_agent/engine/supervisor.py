"""EngineSupervisor: one engine process per replica of the assigned deployment, whichever
engine the deployment names (`engine`: trtllm, vllm, sglang; fleet_core/engines gives each one's
parameter check, parallelism, command line, config files and health path).

Per replica (its GPUs pinned with CUDA_VISIBLE_DEVICES, port base_port + i, its own process
group, stdout and stderr appended to work_dir/<deployment>/replica-<i>.log):

    starting ─spawn─▶ loading ─/health 200─▶ ready ─/health fails─▶ unhealthy ─200─▶ ready
                        │ exits, or not ready          │ exits            │ exits, or still
                        │ within load_timeout_s        ▼                  │ unhealthy after
                        └──────────────────────▶ restarting ◀─────────────┘ unhealthy_restart_s
                                                   │ backoff (restart_backoff_s doubling,
                                                   │ capped) then spawn again (restarts += 1)
                                                   ▼ max_consecutive_crashes in a row
                                                 failed (until a different assignment)

`starting` also covers waiting for the previous deployment's engines to exit (they hold the same
GPUs and ports). The consecutive-crash count resets once a replica stays ready stable_after_s.
Load time is spawn → first /health 200.

Threading: the daemon calls `apply()` with each assignment it hears (cheap, never blocks: old
engines get SIGTERM and are reaped by later polls) and either calls `poll()` every tick or lets
`start()` run a background thread that polls every poll_interval_s (recommended: readiness and
restarts then do not wait for the heartbeat interval). One poll probes every replica
concurrently with http_timeout_s timeouts, so it takes about 3 × http_timeout_s at worst. State
is guarded by one lock; HTTP runs outside it. `stop_all()` blocks (SIGTERM, then SIGKILL after
the grace period, all replicas at once): for shutdown and the end of a drain.
Stats (fleet_agent/engine/replica_stats.py): the supervisor is the ONLY reader of each engine's
metrics paths (fleet_agent/engine/scrape: per-engine parsers into one EngineSample); every poll
folds them into the replica's figures. A layout no parser knows keeps the replica serving, its
figures unknown and last_error saying "unsupported engine version: ...".

Versions: before an engine kind first starts with a command, its version is asked (no shell,
version_timeout_s) and checked against the spec's supported range; a refusal fails the replicas
with that one line (no restart loop), asked once per (engine, command).

Engines survive their agent (records.py, leash.py): each runs under the leash, whose lease file
every poll touches; a record per replica (pid, start time, port, what it runs) lets the next
supervisor on the same work_dir adopt a live engine of the same assignment (ready at once, no
spawn) and retire any other left running; an engine nobody polls for leash_bound_s stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx

from fleet_agent.engine import scrape
from fleet_agent.engine.records import (
    AdoptedProcess,
    EngineProcess,
    EngineRecord,
    find_records,
    fingerprint,
    is_running,
    process_start_time,
    read_record,
    remove_record,
    write_record,
)
from fleet_agent.engine.replica_stats import ReplicaStats, update_stats
from fleet_core.engines import DEFAULT_ENGINE, EngineSpec, LaunchSpec, spec
from fleet_core.engines.layout import (
    cuda_visible_devices,
    model_path,
    replica_layout,
    replica_ports,
)

log = logging.getLogger("fleet_agent.engine")

State = Literal[
    "starting", "loading", "ready", "unhealthy", "restarting", "failed", "stopping", "stopped"
]
_LOG_MAX_BYTES = 64 * 1024 * 1024  # a crash-looping engine's log is rotated once past this
_PROBE_WORKERS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    work_dir: Path  # per deployment: the extra-options YAML and one log per replica
    engine_command: tuple[str, ...] = ("trtllm-serve",)  # trtllm's (kept for old settings)
    # Other engines' commands by engine name ("vllm", "sglang"; "trtllm" overrides the one
    # above); an engine not named here runs its spec's default_command.
    engine_commands: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Before an engine kind first starts with a command, its version is asked (version_argv,
    # at most version_timeout_s) and checked against what this agent drives.
    check_versions: bool = True
    version_timeout_s: float = 60.0
    # Engines outlive a crashed agent (the next one adopts them, records.py) but not a dead
    # one: each runs under the leash (leash.py), which stops it when the supervisor has not
    # touched its lease for leash_bound_s. None: no leash (the engine is the direct child).
    leash_bound_s: float | None = 300.0
    python: str = sys.executable  # runs the leash
    host: str = "127.0.0.1"
    base_port: int = 8100
    load_timeout_s: float = 900.0  # large models take minutes to load
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    max_consecutive_crashes: int = 5
    stop_grace_s: float = 30.0  # SIGTERM lets trtllm-serve finish in-flight requests
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Weights the agent fetched: the cache's engine_path, passed to apply(). Weights Fleet
    # does not fetch (external versions, older fleets) live at
    # model_root/<deployment>/<basename of model_uri> (work_dir/models if None), and their
    # engines get `external_env` on top of extra_env (the lab's stand-in: no weights there).
    model_root: Path | None = None
    external_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    poll_interval_s: float = 1.0  # the background thread's (start())
    http_timeout_s: float = 1.0  # per request: a poll never blocks the agent for long
    stable_after_s: float = 60.0  # ready this long: the consecutive-crash count starts over
    unhealthy_restart_s: float = 60.0  # alive but failing /health this long: restarted
    stats_window_s: float = 60.0  # latency quantiles and tokens/s over this window

    def __post_init__(self) -> None:
        if not self.engine_command:
            raise ValueError("engine_command is empty")
        for engine, command in self.engine_commands.items():
            spec(engine)  # ValueError naming the engines there are
            if not command:
                raise ValueError(f"engine_commands[{engine!r}] is empty")
        if self.max_consecutive_crashes < 1:
            raise ValueError("max_consecutive_crashes must be at least 1")
        for name in (
            "load_timeout_s",
            "poll_interval_s",
            "http_timeout_s",
            "stats_window_s",
            "version_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.leash_bound_s is not None and self.leash_bound_s <= 0:
            raise ValueError("leash_bound_s must be positive (None: no leash)")

    def command(self, engine: str) -> tuple[str, ...]:
        """The program `engine`'s replicas run: engine_commands, then engine_command for
        trtllm, then the spec's default_command."""
        if engine in self.engine_commands:
            return tuple(self.engine_commands[engine])
        if engine == "trtllm":
            return self.engine_command
        return spec(engine).default_command


# ---------------------------------------------------------------------------------------------
# per-replica bookkeeping


@dataclasses.dataclass(eq=False)
class _Replica:
    index: int
    gpus: tuple[int, ...]
    port: int
    url: str
    argv: list[str]
    log_path: Path
    engine: str = DEFAULT_ENGINE
    command: tuple[str, ...] = ()  # the engine's program (version checked before a spawn)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # on top of extra_env
    fingerprint: str = ""  # records.fingerprint of the assignment and argv (set by apply)
    state: State = "starting"
    proc: EngineProcess | None = None  # the leash's (or engine's) process, ours or adopted
    spawned_at: float | None = None
    ready_since: float | None = None
    unhealthy_since: float | None = None
    next_start_at: float = 0.0
    restarts: int = 0
    crashes: int = 0  # consecutive
    load_seconds: float | None = None
    last_error: str | None = None
    stats: ReplicaStats = dataclasses.field(default_factory=ReplicaStats)

    @property
    def record_path(self) -> Path:
        return self.log_path.with_name(f"replica-{self.index}.json")

    @property
    def lease_path(self) -> Path:
        return self.log_path.with_name(f"replica-{self.index}.lease")


@dataclasses.dataclass(frozen=True)
class _Probe:
    at: float
    health: int | None  # None: refused, timed out, or no HTTP answer
    error: str | None = None
    sample: scrape.EngineSample | None = None
    unsupported: str | None = None  # the parser knew none of the engine's metrics (one line)


@dataclasses.dataclass(frozen=True)
class _Retiring:
    proc: EngineProcess
    kill_at: float


# ---------------------------------------------------------------------------------------------


class EngineSupervisor:
    def __init__(
        self, config: SupervisorConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self._lock = threading.RLock()
        self._poll_lock = threading.Lock()  # one poll at a time (thread or daemon tick)
        self._replicas: list[_Replica] = []
        self._retiring: list[_Retiring] = []
        self._identity: str | None = None
        self._deployment: str | None = None
        self._version: str | None = None  # the model version key the engines serve
        self._assignment_error: str | None = None
        self._engine: str | None = None  # the engine the replicas run
        # (engine, command) -> None when its version is one this agent drives, else why not.
        self._version_checks: dict[tuple[str, tuple[str, ...]], str | None] = {}
        self._client = httpx.Client(
            timeout=config.http_timeout_s,
            trust_env=False,  # never send 127.0.0.1 probes through an HTTP(S)_PROXY
            limits=httpx.Limits(max_keepalive_connections=0),  # engines restart on one port
        )
        self._pool = ThreadPoolExecutor(_PROBE_WORKERS, thread_name_prefix="engine-probe")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -----------------------------------------------------------------------------------------
    # what the daemon reads

    @property
    def deployment(self) -> str | None:
        with self._lock:
            return self._deployment

    @property
    def version(self) -> str | None:
        """The model version ("<model>@<version>") the engines run, when the assignment named
        one."""
        with self._lock:
            return self._version

    @property
    def engine(self) -> str | None:
        """The engine ("trtllm", "vllm", "sglang") the assigned deployment runs."""
        with self._lock:
            return self._engine

    @property
    def assignment_error(self) -> str | None:
        with self._lock:
            return self._assignment_error

    @property
    def ready(self) -> bool:
        """Every replica ready (False with no replicas: nothing serves)."""
        with self._lock:
            return bool(self._replicas) and all(r.state == "ready" for r in self._replicas)

    def in_flight(self) -> int:
        """Running + queued requests over all replicas, from the latest stats."""
        with self._lock:
            return sum(
                (r.stats.running or 0) + (r.stats.queued or 0)
                for r in self._replicas
                if r.proc is not None
            )

    def iteration_stats(self, index: int) -> list[dict[str, Any]]:
        """Replica `index`'s raw /metrics entries from the latest poll (empty when none)."""
        with self._lock:
            for r in self._replicas:
                if r.index == index:
                    return [dict(e) for e in r.stats.entries]
            raise IndexError(f"no replica {index}")

    def replica_stats(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per replica."""
        with self._lock:
            return [self._describe(r) for r in self._replicas]

    def _describe(self, r: _Replica) -> dict[str, Any]:
        s = r.stats
        return {
            "index": r.index,
            "gpus": list(r.gpus),
            "port": r.port,
            "url": r.url,
            "state": r.state,
            "pid": r.proc.pid if r.proc is not None else None,
            "restarts": r.restarts,
            "load_seconds": r.load_seconds,
            "queued": s.queued,
            "running": s.running,
            "kv_used_fraction": s.kv_used_fraction,
            "cache_hit_rate": s.cache_hit_rate,
            "tokens_per_s": s.tokens_per_s,
            "ttft_p50_s": s.ttft_p50_s,
            "ttft_p95_s": s.ttft_p95_s,
            "e2e_p50_s": s.e2e_p50_s,
            "e2e_p95_s": s.e2e_p95_s,
            "preemptions": s.preemptions,
            "last_error": r.last_error,
            "version": self._version,
            "engine": r.engine,
        }

    # -----------------------------------------------------------------------------------------
    # the assignment

    def apply(
        self,
        assignment: Mapping[str, Any] | None,
        gpus: Sequence[int] | None = None,
        *,
        model_dir: Path | None = None,
    ) -> None:
        """Run what the fleet assigned. Idempotent; never blocks on engines.

        `serve` with the same deployment, parameters and layout as now: nothing changes. A
        different one: every engine gets SIGTERM (reaped, or SIGKILLed after stop_grace_s, by
        later polls) and the new replicas start once they are gone. `none` (or None): the
        engines stop the same way. `drain`: nothing changes here; the daemon drains (waits for
        in_flight() to reach 0, then stop_all()). `gpus`: this host's GPU indexes (default:
        0 .. replicas × gpus_per_replica - 1). `model_dir`: the checkpoint directory of a
        version the agent fetched (its weights cache); None: model_root/<deployment>/<basename
        of model_uri>. The assignment's `stage` and `keep` lists are the cache's business: a
        change there restarts nothing. An invalid assignment stops the engines, is remembered
        (assignment_error) and raises ValueError, again on every repeat.
        """
        kind = "none" if assignment is None else assignment.get("kind", "none")
        if kind == "drain":
            return
        if kind == "none":
            with self._lock:
                if self._identity is not None or self._replicas:
                    log.info("assignment none: stopping the engines of %s", self._deployment)
                self._retire_all()
                self._identity = self._deployment = self._assignment_error = None
                self._version = self._engine = None
            return
        assert assignment is not None
        assignment = {k: v for k, v in assignment.items() if k not in _CACHE_ONLY}
        if model_dir is not None:
            assignment["model_dir"] = str(model_dir)
        with self._lock:
            try:
                if kind != "serve":
                    raise ValueError(f"unknown assignment kind {kind!r}")
                replicas, files, name = self._plan(assignment, gpus, model_dir)
            except ValueError as exc:
                identity = _identity(assignment, None if gpus is None else sorted(gpus))
                if identity == self._identity and self._assignment_error is not None:
                    raise ValueError(self._assignment_error) from exc
                log.error("invalid assignment, engines stopped: %s", exc)
                self._retire_all()
                self._identity, self._deployment, self._version = identity, None, None
                self._assignment_error = str(exc)
                raise
            # The same deployment, parameters and GPU layout: the engines keep running.
            identity = _identity(assignment, [r.gpus for r in replicas])
            if identity == self._identity:
                return
            self._retire_all()
            self._identity = self._deployment = self._version = None  # until the new one runs
            deploy_dir = replicas[0].log_path.parent
            deploy_dir.mkdir(parents=True, exist_ok=True)
            for file_name, text in files.items():
                _write_atomic(deploy_dir / file_name, text)
            for r in replicas:
                r.fingerprint = fingerprint(identity, r.argv)
            self._replicas = replicas
            self._engine = replicas[0].engine if replicas else None
            self._adopt(self.clock())
            self._identity, self._deployment, self._assignment_error = identity, name, None
            self._version = _version_key(assignment)
            log.info(
                "serving %s%s: %d replica(s) on GPUs %s",
                name,
                f" ({self._version})" if self._version else "",
                len(replicas),
                [r.gpus for r in replicas],
            )
            self._spawn_due(self.clock())

    def _plan(
        self, assignment: Mapping[str, Any], gpus: Sequence[int] | None, model_dir: Path | None
    ) -> tuple[list[_Replica], dict[str, str], str]:
        """The replicas of `assignment`, the config files their engine reads (name in the
        deployment's work dir -> text) and the deployment's name; ValueError when invalid."""
        cfg = self.config
        name = assignment.get("deployment")
        uri = assignment.get("model_uri")
        per_replica = assignment.get("gpus_per_replica")
        wanted = assignment.get("replicas") or 0
        params = assignment.get("engine_params") or {}
        engine = spec(assignment.get("engine") or DEFAULT_ENGINE)
        if not isinstance(name, str) or not name:
            raise ValueError("assignment.deployment is missing")
        if model_dir is None and (not isinstance(uri, str) or not uri):
            raise ValueError("assignment.model_uri is missing")
        if not isinstance(per_replica, int) or isinstance(per_replica, bool):
            raise ValueError("assignment.gpus_per_replica must be an integer")
        if not isinstance(wanted, int) or wanted < 0:
            raise ValueError("assignment.replicas must be a non-negative integer")
        if not isinstance(params, Mapping):
            raise ValueError("assignment.engine_params must be a mapping")
        engine.check_params(params)
        tp, pp = engine.parallelism(params)
        if tp * pp != per_replica:
            tp_key, pp_key = engine.parallel_keys
            raise ValueError(
                f"gpus_per_replica ({per_replica}) must equal {tp_key} × {pp_key} ({tp} × {pp})"
            )
        host_gpus = list(gpus) if gpus is not None else list(range(wanted * per_replica))
        layout = replica_layout(host_gpus, per_replica)
        if wanted:
            layout = layout[:wanted]  # more GPUs than the fleet counted on: leave them idle
        if len(layout) < wanted:
            log.warning(
                "%s: room for %d of the %d replicas assigned (GPUs %s)",
                name,
                len(layout),
                wanted,
                host_gpus,
            )
        ports = replica_ports(cfg.base_port, len(layout))
        deploy_dir = cfg.work_dir / name
        root = cfg.model_root if cfg.model_root is not None else cfg.work_dir / "models"
        if model_dir is not None:
            model, env = str(model_dir), {}
        else:
            model, env = str(model_path(root, name, str(uri))), dict(cfg.external_env)
        command = cfg.command(engine.name)
        files: dict[str, str] = {}
        replicas: list[_Replica] = []
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        for i, (group, port) in enumerate(zip(layout, ports, strict=True)):
            launch = engine.launch(
                LaunchSpec(
                    command=command,
                    model_path=model,
                    served_names=_served_names(name, assignment),
                    params=params,
                    host=cfg.host,
                    port=port,
                    config_dir=str(deploy_dir),
                )
            )
            files.update(launch.files)  # the same for every replica (ports are on argv)
            replicas.append(
                _Replica(
                    index=i,
                    gpus=group,
                    port=port,
                    url=f"http://{host}:{port}",
                    argv=launch.argv,
                    log_path=deploy_dir / f"replica-{i}.log",
                    engine=engine.name,
                    command=command,
                    env=env,
                )
            )
        return replicas, files, name

    def _adopt(self, now: float) -> None:
        """Take over the engines a previous agent left running (their records in work_dir):
        one started for this very replica (same assignment, argv and port), alive with the
        recorded start time and answering its health path, is ready at once; others alive
        are retired like any old engine; the records of dead ones are removed."""
        wanted = {r.record_path: r for r in self._replicas}
        for path in find_records(self.config.work_dir):
            record = read_record(path)
            if record is None or not is_running(record.pid, record.start_time):
                remove_record(path)
                continue
            r = wanted.get(path)
            proc = AdoptedProcess(record.pid, record.start_time)
            if (
                r is not None
                and r.proc is None
                and record.identity == r.fingerprint
                and record.port == r.port
                and self._answers(r)
            ):
                _touch(r.lease_path)
                r.proc, r.state = proc, "ready"
                r.spawned_at = r.ready_since = now
                log.info("replica %d: adopted pid %d on port %d", r.index, record.pid, r.port)
                continue
            log.info("retiring pid %d left by a previous agent (%s)", record.pid, path)
            _killpg(record.pid, signal.SIGTERM)
            self._retiring.append(_Retiring(proc, now + self.config.stop_grace_s))
            remove_record(path)

    def _answers(self, r: _Replica) -> bool:
        try:
            reply = self._client.get(r.url + spec(r.engine).health_path)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    # -----------------------------------------------------------------------------------------
    # one round

    def poll(self) -> None:
        """Reap, (re)start, probe /health and scrape stats of every replica, once."""
        if not self._poll_lock.acquire(blocking=False):
            return  # a round is already running (background thread and a daemon tick)
        try:
            with self._lock:
                now = self.clock()
                self._reap_retiring(now)
                for r in self._replicas:
                    self._check_process(r, now)
                    if r.proc is not None:
                        _touch(r.lease_path)  # the leash's sign that the agent lives
                self._spawn_due(now)
                targets = [(r, r.proc) for r in self._replicas if r.proc is not None]
            probes = list(
                self._pool.map(lambda t: self._probe(t[0].url, spec(t[0].engine)), targets)
            )
            with self._lock:
                for (r, proc), probe in zip(targets, probes, strict=True):
                    if r in self._replicas and r.proc is proc:  # not replaced meanwhile
                        self._observe(r, probe)
        finally:
            self._poll_lock.release()

    def _check_process(self, r: _Replica, now: float) -> None:
        cfg = self.config
        if r.proc is None:
            return
        code = r.proc.poll()
        if code is not None:
            self._crashed(r, now, f"engine exited with code {code}{_log_tail(r.log_path)}")
        elif (
            r.state == "loading"
            and r.spawned_at is not None
            and now - r.spawned_at > cfg.load_timeout_s
        ):
            self._kill(r)
            self._crashed(r, now, f"not ready within load_timeout_s ({cfg.load_timeout_s:g} s)")
        elif (
            r.state == "unhealthy"
            and r.unhealthy_since is not None
            and now - r.unhealthy_since > cfg.unhealthy_restart_s
        ):
            self._kill(r)
            self._crashed(
                r, now, f"unhealthy for {cfg.unhealthy_restart_s:g} s: {r.last_error or ''}"
            )

    def _spawn_due(self, now: float) -> None:
        if self._retiring:  # the previous engines still hold these GPUs and ports
            return
        for r in self._replicas:
            if r.state in {"starting", "restarting"} and r.proc is None and now >= r.next_start_at:
                refused, definitive = self._check_version(r.engine, r.command)
                if refused is not None and definitive:
                    r.state, r.last_error = "failed", refused  # no restart loop: it stays wrong
                    continue
                if refused is not None:  # could not ask (slow, missing): asked again later
                    self._crashed(r, now, refused)
                    continue
                self._spawn(r, now)

    def _check_version(self, engine: str, command: tuple[str, ...]) -> tuple[str | None, bool]:
        """(None, True) when `command` runs a version of `engine` this agent drives, else (why
        not in one line, definitive). A version it does not drive is definitive: remembered per
        (engine, command) and logged once. A question that got no answer (a timeout, a missing
        program, a failing command) is not: the replica backs off and asks again."""
        if not self.config.check_versions:
            return None, True
        key = (engine, command)
        if key in self._version_checks:
            return self._version_checks[key], True
        refused, definitive = _ask_version(spec(engine), command, self.config.version_timeout_s)
        if refused is None:
            log.info("engine %s: %s answers a supported version", engine, command[0])
        else:
            log.error("engine %s refused: %s", engine, refused)
        if definitive:
            self._version_checks[key] = refused
        return refused, definitive

    def _spawn(self, r: _Replica, now: float) -> None:
        cfg = self.config
        if r.state == "restarting":
            r.restarts += 1
        r.stats = ReplicaStats()
        if not _port_free(cfg.host, r.port):
            self._crashed(r, now, f"port {r.port} on {cfg.host} is in use by another process")
            return
        # The agent's own settings (its fleet token among them) are none of the engine's business.
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_AGENT_")}
        env.update(cfg.extra_env)
        env.update(r.env)
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(r.gpus)
        argv = r.argv
        if cfg.leash_bound_s is not None:
            argv = [cfg.python, "-m", "fleet_agent.engine.leash", "--lease", str(r.lease_path)]
            argv += ["--bound", f"{cfg.leash_bound_s:g}", "--grace", f"{cfg.stop_grace_s:g}"]
            argv += ["--", *r.argv]
        try:
            r.log_path.parent.mkdir(parents=True, exist_ok=True)
            _touch(r.lease_path)
            _rotate(r.log_path)
            with open(r.log_path, "ab") as out:
                out.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {r.argv}\n".encode())
                out.flush()
                proc = r.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=r.log_path.parent,
                    start_new_session=True,  # its own process group: MPI ranks go with it
                )
        except OSError as exc:
            self._crashed(r, now, f"cannot start {argv[0]}: {exc}")
            return
        started = process_start_time(proc.pid)
        if started is not None:  # None: it is gone already; the next poll sees the exit
            record = EngineRecord(
                pid=proc.pid,
                start_time=started,
                port=r.port,
                index=r.index,
                deployment=r.log_path.parent.name,
                engine=r.engine,
                version=self._version,
                identity=r.fingerprint,
            )
            try:
                write_record(r.record_path, record)
            except OSError as exc:  # the engine serves; only adoption after a crash is lost
                log.warning("replica %d: cannot write its record: %s", r.index, exc)
        r.state, r.spawned_at, r.ready_since, r.unhealthy_since = "loading", now, None, None
        log.info(
            "replica %d: started pid %d on GPUs %s, port %d", r.index, r.proc.pid, r.gpus, r.port
        )

    def _crashed(self, r: _Replica, now: float, error: str) -> None:
        cfg = self.config
        if r.proc is not None:
            _killpg(r.proc.pid, signal.SIGKILL)  # ranks the leader left behind
        r.proc = None
        remove_record(r.record_path)
        r.crashes += 1
        r.last_error = error[:1000]
        r.stats = ReplicaStats()
        r.ready_since = r.unhealthy_since = None
        if r.crashes >= cfg.max_consecutive_crashes:
            r.state = "failed"
            log.error("replica %d failed after %d crashes in a row: %s", r.index, r.crashes, error)
            return
        backoff = min(cfg.restart_backoff_s * 2 ** (r.crashes - 1), cfg.restart_backoff_max_s)
        r.state, r.next_start_at = "restarting", now + backoff
        log.warning("replica %d: %s; restarting in %.1f s", r.index, error, backoff)

    def _kill(self, r: _Replica) -> None:
        if r.proc is not None:
            _killpg(r.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=1.0)

    def _probe(self, url: str, engine: EngineSpec) -> _Probe:
        """GET the engine's health path; when 200, also its metrics paths, parsed into one
        EngineSample. No lock held."""
        try:
            health = self._client.get(url + engine.health_path).status_code
        except httpx.HTTPError as exc:
            return _Probe(self.clock(), None, f"{engine.health_path}: {type(exc).__name__}: {exc}")
        at = self.clock()  # load time ends at the first 200, not after the scrapes
        if health != 200:
            return _Probe(at, health, f"{engine.health_path} answered {health}")
        errors: list[str] = []
        texts: dict[str, str] = {}
        for path in scrape.metrics_paths(engine.name):
            try:
                reply = self._client.get(url + path)
                reply.raise_for_status()
                texts[path] = reply.text
            except httpx.HTTPError as exc:
                errors.append(f"{path}: {exc}")
        try:
            sample = scrape.parse(engine.name, texts)
        except scrape.UnsupportedEngineVersion as exc:
            return _Probe(at, 200, "; ".join(errors) or None, None, str(exc).splitlines()[0])
        except (ValueError, ArithmeticError) as exc:  # a text it cannot read: this poll
            errors.append(f"metrics: {exc}")  # reads nothing
            sample = None
        return _Probe(at, 200, "; ".join(errors) or None, sample)

    def _observe(self, r: _Replica, probe: _Probe) -> None:
        cfg = self.config
        if probe.health != 200 and r.proc is not None and r.proc.poll() is not None:
            self._check_process(r, probe.at)  # it died during the probe: a crash, not unhealthy
            return
        if probe.health != 200:
            if r.state == "ready":
                r.state, r.unhealthy_since = "unhealthy", probe.at
                log.warning("replica %d: not healthy: %s", r.index, probe.error)
            if r.state == "unhealthy":
                r.last_error = probe.error
            return
        if r.state == "loading":
            r.load_seconds = probe.at - (r.spawned_at or probe.at)
            log.info("replica %d: ready after %.1f s", r.index, r.load_seconds)
        if r.state in {"loading", "unhealthy"}:
            r.state, r.ready_since, r.unhealthy_since = "ready", probe.at, None
        if (
            r.crashes
            and r.ready_since is not None
            and probe.at - r.ready_since >= cfg.stable_after_s
        ):
            r.crashes = 0
        if probe.error:
            log.debug("replica %d: %s", r.index, probe.error)
        if probe.unsupported is not None:
            if r.last_error != probe.unsupported:
                log.error("replica %d: %s", r.index, probe.unsupported)
            r.last_error = probe.unsupported  # it serves; its load figures are unknown
        elif r.last_error is not None and r.last_error.startswith("unsupported engine version"):
            r.last_error = None
        update_stats(r.stats, probe.at, probe.sample, cfg.stats_window_s)

    # -----------------------------------------------------------------------------------------
    # stopping

    def _retire_all(self) -> None:
        """SIGTERM every engine; later polls reap them (SIGKILL after stop_grace_s)."""
        kill_at = self.clock() + self.config.stop_grace_s
        for r in self._replicas:
            if r.proc is not None:
                _killpg(r.proc.pid, signal.SIGTERM)
                self._retiring.append(_Retiring(r.proc, kill_at))
                r.proc = None
            remove_record(r.record_path)
            r.state = "stopping"
        self._replicas = []

    def _reap_retiring(self, now: float) -> None:
        left: list[_Retiring] = []
        for old in self._retiring:
            if old.proc.poll() is not None:
                _killpg(old.proc.pid, signal.SIGKILL)  # its leftover ranks, if any
            else:
                if now >= old.kill_at:
                    log.warning("engine pid %d ignored SIGTERM: SIGKILL", old.proc.pid)
                    _killpg(old.proc.pid, signal.SIGKILL)
                left.append(old)
        self._retiring = left

    def stop_all(self, grace_s: float | None = None) -> None:
        """Stop every engine now: SIGTERM to all at once, SIGKILL to those still running after
        grace_s (default stop_grace_s). Blocks until they are gone. The assignment is forgotten:
        the next apply() starts afresh."""
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        with self._lock:
            for r in self._replicas:
                r.state = "stopping"
            procs = [r.proc for r in self._replicas if r.proc is not None]
            procs += [old.proc for old in self._retiring]
            for r in self._replicas:
                remove_record(r.record_path)
            self._replicas, self._retiring = [], []
            self._identity = self._deployment = self._assignment_error = None
            self._version = self._engine = None
        _terminate(procs, grace)

    # -----------------------------------------------------------------------------------------
    # the optional background thread

    def start(self) -> None:
        """Poll every poll_interval_s on a thread of its own until close()."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # one bad round must not end supervision
                log.exception("engine supervisor poll failed")
            self._stop.wait(self.config.poll_interval_s)

    def close(self, grace_s: float | None = None) -> None:
        """Stop the thread (if any), every engine (stop_all), and the HTTP client."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=4 * self.config.http_timeout_s + 5.0)
            self._thread = None
        self.stop_all(grace_s)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> EngineSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Assignment fields the weights cache reads and the engines do not.
_CACHE_ONLY = frozenset({"stage", "keep"})


def _version_key(assignment: Mapping[str, Any]) -> str | None:
    model = assignment.get("model")
    key = model.get("key") if isinstance(model, Mapping) else None
    return key if isinstance(key, str) and key else None


def _served_names(deployment: str, assignment: Mapping[str, Any]) -> tuple[str, ...]:
    """The names clients send as "model": the deployment's, and the served model's (the
    version's model name, else the basename of model_uri), once each."""
    model = assignment.get("model")
    served = model.get("model") if isinstance(model, Mapping) else None
    if not isinstance(served, str) or not served:
        uri = assignment.get("model_uri")
        served = uri.rstrip("/").rsplit("/", 1)[-1] if isinstance(uri, str) else None
    names = [deployment] + ([served] if served else [])
    return tuple(dict.fromkeys(names))


def _ask_version(
    engine: EngineSpec, command: Sequence[str], timeout_s: float
) -> tuple[str | None, bool]:
    """Run engine.version_argv(command) (no shell) and check what it printed: (None, True) when
    this agent drives that version, else (one line saying why not, whether that is final: a
    version it does not drive is; a command that gave no answer is not)."""
    argv = engine.version_argv(command)
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{engine.program}: cannot ask its version ({argv[0]}): {exc}", False
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()
        tail = f": {last[-1][:200]}" if last else ""
        why = f"{engine.program}: {' '.join(argv)[:200]} exited with {done.returncode}{tail}"
        return why, False
    try:
        engine.check_version(done.stdout if done.stdout.strip() else done.stderr)
    except ValueError as exc:
        return str(exc).splitlines()[0], True
    return None, True


def _identity(assignment: Mapping[str, Any], layout: Any) -> str:
    return json.dumps(
        {"assignment": dict(assignment), "layout": layout}, sort_keys=True, default=repr
    )


# ---------------------------------------------------------------------------------------------
# processes and files


def _killpg(pid: int, sig: signal.Signals) -> None:
    """Signal the engine's whole process group (trtllm-serve's MPI ranks included)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _terminate(procs: Iterable[EngineProcess], grace_s: float) -> None:
    """SIGTERM all at once; SIGKILL whatever still runs at the shared deadline."""
    procs = list(procs)
    for proc in procs:
        _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + max(grace_s, 0.0)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.poll() is None:
            log.warning("engine pid %d still running after %.1f s: SIGKILL", proc.pid, grace_s)
        _killpg(proc.pid, signal.SIGKILL)  # the leader if it lingers, its ranks in any case
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)


def _port_free(host: str, port: int) -> bool:
    """Whether the engine will be able to bind its port (another process listening: no)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _log_tail(path: Path, limit: int = 300) -> str:
    """': <last line of the log>' (the engine's own last word on why it exited), or ''."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln and not ln.startswith("=== ")]
    return f": {lines[-1][:limit]}" if lines else ""


def _rotate(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.stat().st_size > _LOG_MAX_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.touch()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
