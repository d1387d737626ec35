"""When a heartbeat changes nothing the fleet decides on: the steady key.

A server's agent sends the same report every few seconds, and in a healthy fleet nearly every
report differs from the last one only in what it measures: GPU temperatures and power, the
replicas' queues and latencies, the cache's free disk, the time. Everything the fleet acts on
(the verdict and its action, the reasons, readiness and draining, each GPU's health, the
replicas' identities, states and URLs, the weights cache's versions) is the same. Such a report
needs no Event, no wake-up of the provisioner, no GPU row written and no new assignment: only
its measurements stored. `steady_key` is that "everything acted on", so that two reports with
equal keys are handled the same way (fleet/registry/heartbeat_ingest.py relies on it: its fast
path answers a report whose key equals the last fully handled one's).

Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Hashable

from fleet_core.wire import Heartbeat


def steady_key(report: Heartbeat, peer: str | None) -> Hashable:
    """What of `report` (received from `peer`) the fleet acts on. Equal keys: the same Events
    (none), wake-ups (none), GPU health writes (none), URL verdicts and assignment.

    Left out, because they are measurements the fleet stores but never acts on when they
    change: each GPU's telemetry (temperature, memory, utilisation, power, its limit) and uuid
    (a heartbeat does not record uuids; registration does), each replica's counters and
    latencies (queued, running, KV use, throughput, TTFT, restarts, pid), the cache's free
    bytes on its file system, and the snapshot's time."""
    cache = report.cache
    return (
        report.server,
        peer,
        report.verdict,
        report.action,
        tuple((r.code, r.gpu, r.message, r.action, r.verdict) for r in report.reasons),
        report.draining,
        report.ready,
        tuple((g.index, g.health, g.lost) for g in report.gpus),
        tuple((r.index, tuple(r.gpus), r.port, r.url, r.state) for r in report.replicas),
        None
        if cache is None
        else (
            cache.budget_bytes,
            cache.used_bytes,
            tuple(
                (
                    e.key,
                    e.state,
                    e.bytes,
                    e.total_bytes,
                    e.verified_at,
                    e.last_used_at,
                    e.error,
                    e.resumes,
                    e.checksum_failures,
                )
                for e in cache.entries
            ),
        ),
    )
