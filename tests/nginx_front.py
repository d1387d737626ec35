"""Debian's nginx as the load balancer in front of several `fleetctl serve` replicas (tests only).

`nginx_front(upstreams, workdir)` starts nginx on a free 127.0.0.1 port, balancing over the
given `http://127.0.0.1:PORT` URLs round-robin, with upstream keepalive, and yields its URL;
it is stopped (TERM, then KILL) on the way out. What an operator would configure:

- `proxy_next_upstream error timeout`: a request that could not be sent to a replica (refused,
  reset before an answer, connect timeout) goes to the next one. nginx never resends a
  non-idempotent request (POST, PATCH) once it reached a replica: that is the client's to
  retry, as the replicas test does.
- `max_fails=1 fail_timeout=3s`: a dead replica is skipped for 3 s after one failure.
- no proxy buffering and a long read timeout: `fleetctl events --follow` and the agents' long
  requests pass through as they come.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from weights_peers import nginx_binary, stop_process, wait_listening

from fleet.lab.sushy import free_port

CONF = """\
{user}worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {tmp}/access.log combined;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_max_body_size 64m;
    upstream fleet {{
{servers}
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_connect_timeout 1s;
            proxy_read_timeout 120s;
            proxy_buffering off;
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;
        }}
    }}
}}
"""


@dataclass(frozen=True)
class NginxFront:
    url: str
    port: int
    pid: int
    access_log: Path
    error_log: Path

    def upstream_errors(self) -> list[str]:
        """The error log's lines about upstreams (a replica refused, reset, timed out)."""
        try:
            text = self.error_log.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if "upstream" in line]


@contextmanager
def nginx_front(upstreams: Sequence[str], workdir: Path) -> Iterator[NginxFront]:
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
    tmp = workdir / "nginx-front"
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    servers = "\n".join(
        f"        server {url.removeprefix('http://')} max_fails=1 fail_timeout=3s;"
        for url in upstreams
    )
    conf = tmp / "nginx.conf"
    # As root, workers would drop to nobody and could not write a test's private temp dir.
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf.write_text(CONF.format(user=user, tmp=tmp, port=port, servers=servers))
    error_log = tmp / "error.log"
    with (tmp / "nginx.out").open("ab") as out:
        proc = subprocess.Popen(
            [binary, "-p", str(tmp), "-c", str(conf), "-e", str(error_log)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_listening(port, proc, "nginx", error_log)
        yield NginxFront(f"http://127.0.0.1:{port}", port, proc.pid, tmp / "access.log", error_log)
    finally:
        stop_process(proc)
