"""The router's worker view: the fleet's routing table, then every agent's /state.

- Every `fleet_poll_s`: GET /api/v1/routing — the deployments, the names requests may use for
  each, their engine's priority fields (fleet/router/priority.py), and the replicas of
  serving servers with a fresh heartbeat. New replicas join with the cost model's capacity
  prior; gone ones leave (requests in flight on them finish and close
  their books on the objects they hold).
- Every `agent_poll_s` (250 ms): each listed agent's /state — whether it is ready (not
  draining, GPUs healthy), each replica's state, queue, running requests and KV use. Never the
  engines' /metrics, which empties on read (the agent is its one reader). An agent that does
  not answer twice in a row marks its replicas not ready: a killed or drained server gets no
  new request within two polls.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
import yaml

from fleet.router.admission import AdmissionQueue
from fleet.router.config import RouterSettings
from fleet.router.estimates import Throughput, iteration_costs, prior_capacity, stream_rate
from fleet.router.pool import DeploymentPool
from fleet.router.prefix import PrefixIndex, index_capacity
from fleet.router.priority import table_priorities
from fleet.router.strategy import Replica, make
from fleet.tls import client_context

log = logging.getLogger(__name__)
AGENT_MISSES_NOT_READY = 2


def client_tls(settings: RouterSettings) -> ssl.SSLContext:
    """The router's client context, for the polls, the load reports and https engines: the
    fleet's, agents' and engines' certificates verified against `ca_bundle` (else the system's
    CAs), and the router's client certificate for agents that require one."""
    return client_context(settings.ca_bundle, settings.tls_client_cert, settings.tls_client_key)


class WorkerView:
    def __init__(self, settings: RouterSettings, http: aiohttp.ClientSession) -> None:
        self.settings = settings
        self.http = http
        self.pools: dict[str, DeploymentPool] = {}
        self.by_model: dict[str, DeploymentPool] = {}
        self.agents: dict[str, list[Replica]] = {}  # agent URL -> its replicas
        self.agent_misses: dict[str, int] = {}
        # Replica URL -> the version its agent last reported it runs. The agent knows first
        # (it restarted the engine); the table, a heartbeat behind, may name the version the
        # server is moving to while the old one still answers.
        self.agent_versions: dict[str, str] = {}
        self._polls: dict[str, asyncio.Task[None]] = {}
        self.table_ok = False
        self.on_change: Callable[[], None] = lambda: None

    # -- the routing table ----------------------------------------------------------------

    async def poll_fleet(self) -> None:
        if self.settings.table_file is not None:
            loaded = yaml.safe_load(self.settings.table_file.read_text())
            self.apply_table(loaded["results"] if isinstance(loaded, dict) else loaded)
            self.table_ok = True
            return
        headers = {}
        if self.settings.token is not None:
            headers["Authorization"] = f"Bearer {self.settings.token.get_secret_value()}"
        url = f"{self.settings.fleet_url.rstrip('/')}/api/v1/routing"
        timeout = aiohttp.ClientTimeout(total=5)
        async with self.http.get(url, headers=headers, timeout=timeout) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                raise RuntimeError(f"GET {url}: HTTP {response.status}: {text}")
            body = await response.json()
        self.apply_table(body["results"])
        self.table_ok = True

    def apply_table(self, rows: list[dict[str, Any]]) -> None:
        seen: set[str] = set()
        by_model: dict[str, DeploymentPool] = {}
        agents: dict[str, list[Replica]] = {}
        for row in rows:
            name = row["deployment"]
            seen.add(name)
            pool = self.pools.get(name)
            if pool is None:
                pool = self._new_pool(name)
                self.pools[name] = pool
            pool.models = frozenset(row.get("models") or [name])
            pool.engine = str(row.get("engine") or "trtllm")
            pool.priorities = table_priorities(row)
            cold = row.get("cold_start_s")
            pool.cold_start_s = float(cold) if isinstance(cold, int | float) else None
            pool.off = row.get("off") is True
            limit = int(row.get("max_batch_size") or self.settings.replica_limit)
            current: dict[str, Replica] = {}
            for item in row.get("replicas") or []:
                url = str(item["url"]).rstrip("/")
                replica = pool.replicas.get(url)
                if replica is None:
                    gpu = str(item.get("gpu_model", ""))
                    model = str(row.get("model_uri", ""))
                    tp_size = int(row.get("tp_size") or 1)
                    prior = prior_capacity(
                        gpu,
                        model,
                        tp_size=tp_size,
                        concurrency=limit,
                        prefill_weight=self.settings.prefill_weight,
                    )
                    replica = Replica(
                        url=url,
                        server=item.get("server", ""),
                        gpu_model=gpu,
                        capacity=prior,
                        stream_rate=stream_rate(
                            gpu, model, tp_size=tp_size, prefill_weight=self.settings.prefill_weight
                        ),
                        # Not ready until its agent says so (the first /state poll decides);
                        # a replica listed without an agent (a static table) is taken as ready.
                        ready=not item.get("agent_url"),
                        prefix=PrefixIndex(index_capacity(gpu, model, tp_size=tp_size)),
                    )
                    # Prefill and decode weigh differently on each GPU: the strategy prices a
                    # request's prompt and answer with the engine cost model's split.
                    replica.iter_s, replica.token_s, replica.kv_s = iteration_costs(
                        gpu, model, tp_size=tp_size
                    )
                    pool.throughput[url] = Throughput(prior)
                replica.models = pool.models
                replica.limit = limit
                replica.version = self.agent_versions.get(url) or str(item.get("version") or "")
                current[url] = replica
                agent = item.get("agent_url")
                if agent:
                    agents.setdefault(str(agent).rstrip("/"), []).append(replica)
            _unknown_takes_the_mean(current, pool.throughput)
            pool.replicas = current
            pool.throughput = {u: m for u, m in pool.throughput.items() if u in current}
            versions = row.get("versions") or {}
            pool.set_versions(
                str(versions.get("stable") or ""),
                str(versions.get("canary") or ""),
                float(versions.get("canary_weight") or 0.0),
            )
            # A model name several deployments serve goes to the one with the most replicas
            # (the first by name on a tie): a spare staging the same model for another
            # deployment must not capture its traffic. A deployment's own name is unique.
            for model in pool.models:
                held = by_model.get(model)
                if held is None or len(pool.replicas) > len(held.replicas):
                    by_model[model] = pool
        for name in list(self.pools):
            if name not in seen and not len(self.pools[name].queue):
                del self.pools[name]
        self.by_model = by_model
        self.agents = agents
        self.agent_misses = {a: self.agent_misses.get(a, 0) for a in agents}
        listed = {r.url for replicas in agents.values() for r in replicas}
        self.agent_versions = {u: v for u, v in self.agent_versions.items() if u in listed}
        self.on_change()

    def _new_pool(self, name: str) -> DeploymentPool:
        s = self.settings
        return DeploymentPool(
            name=name,
            strategy=make(s.strategy_for(name), s.prefill_weight),
            queue=AdmissionQueue(s.queue_bound),
            prefill_weight=s.prefill_weight,
            eject_after=s.eject_after,
            eject_s=s.eject_s,
        )

    # -- the agents -----------------------------------------------------------------------

    async def poll_agents(self) -> None:
        """One round: a poll for every agent not still answering the last one, then at most
        one poll interval of waiting, so that one hung agent does not slow the others."""
        for url in list(self.agents):
            task = self._polls.get(url)
            if task is None or task.done():
                self._polls[url] = asyncio.create_task(self._poll_agent(url))
        pending = [t for t in self._polls.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.settings.agent_poll_s)
        self._polls = {u: t for u, t in self._polls.items() if u in self.agents or not t.done()}
        if self.agents:
            self.on_change()

    async def _poll_agent(self, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.agent_timeout_s)
        try:
            async with self.http.get(f"{url}/state", timeout=timeout) as response:
                state = await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            state = None
        replicas = self.agents.get(url, [])
        if state is None:
            misses = self.agent_misses.get(url, 0) + 1
            self.agent_misses[url] = misses
            if misses >= AGENT_MISSES_NOT_READY:
                for replica in replicas:
                    replica.ready = False
            return
        self.agent_misses[url] = 0
        apply_agent_state(replicas, state)
        for row in state.get("replicas") or []:
            version = row.get("version") if isinstance(row, dict) and row.get("url") else None
            if isinstance(version, str) and version:
                self.agent_versions[str(row["url"]).rstrip("/")] = version


def _unknown_takes_the_mean(replicas: dict[str, Replica], meters: dict[str, Throughput]) -> None:
    """A replica on hardware the cost model does not know (prior 1.0) starts at the mean of the
    known ones, not at a capacity that would starve it until measured."""
    known = [m.value for u, m in meters.items() if u in replicas and (m.measured or m.value > 1.0)]
    if not known:
        return
    mean = sum(known) / len(known)
    for url, replica in replicas.items():
        meter = meters.get(url)
        if meter is not None and not meter.measured and meter.value <= 1.0:
            meter.value = replica.capacity = mean


def apply_agent_state(replicas: list[Replica], state: dict[str, Any]) -> None:
    """An agent's /state onto its replicas: ready only if the agent is ready (not draining,
    GPUs healthy) and the replica itself is; the model version it runs, when the agent says."""
    agent_ready = bool(state.get("ready")) and not state.get("draining")
    reported = {
        str(r.get("url", "")).rstrip("/"): r for r in state.get("replicas") or [] if r.get("url")
    }
    for replica in replicas:
        row = reported.get(replica.url)
        if row is None:
            replica.ready = False
            continue
        replica.ready = agent_ready and row.get("state") == "ready"
        replica.queued = int(row.get("queued") or 0)
        replica.running = int(row.get("running") or 0)
        kv = row.get("kv_used_fraction")
        replica.kv_use = float(kv) if isinstance(kv, int | float) else None
        # The engine's prefix-cache hit rate weighs the router's prefix credit (prefix.py)
        hit = row.get("cache_hit_rate")
        replica.prefix.engine_rate = float(hit) if isinstance(hit, int | float) else None
        # The agent knows first when a replica restarted on another version (a rollout).
        version = row.get("version")
        if isinstance(version, str) and version:
            replica.version = version
