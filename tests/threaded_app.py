"""An aiohttp app of a test's own (a TEST DOUBLE of an agent or an engine) on 127.0.0.1, with
its own event loop in a thread, so that a synchronous test can run a real router against it.

Not a test module: test modules import it by name (tests/ is on pytest's path).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Self

from aiohttp import web

from fleet.lab.harness import free_port


class ThreadedApp:
    """Subclasses add their routes in `routes`; `with` starts and stops the server."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        self.routes(app)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
