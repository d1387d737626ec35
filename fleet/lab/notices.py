"""The Redfish notice receiver: every lab system has `external_notifier=True`, so sushy-emulator
PUTs the system's JSON here when a Reset is requested (`pending_power` with `apply_time`) and when
it is applied (a new `power_state`). The receiver hands each notice to a callback (the lab's
controller queue) and answers 204.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fleet.lab.processes import HOST

log = logging.getLogger(__name__)

MAX_NOTICE_BYTES = 1 << 20


class _NoticeHandler(BaseHTTPRequestHandler):
    server: NoticeServer

    def do_PUT(self) -> None:  # sushy sends every notice as a PUT of the system's JSON
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_NOTICE_BYTES:
            self.send_error(413 if length else 411)
            return
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            self.send_error(400, "not JSON")
            return
        if isinstance(body, dict):
            self.server.on_notice(body)
        self.send_response(204)
        self.end_headers()

    do_POST = do_PUT

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("notice receiver: " + format, *args)


class NoticeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, on_notice: Callable[[dict[str, Any]], None]) -> None:
        super().__init__((HOST, 0), _NoticeHandler)
        self.on_notice = on_notice

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}/notify"
