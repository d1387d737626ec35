"""A TCP fault proxy for the chaos tests: a real socket on 127.0.0.1 between a client and the
peer it talks to (a BMC emulator, the fleet service, an agent), which on command stops behaving
like a working network.

    with TcpFaultProxy(target_port, name="bmc") as proxy:
        url = proxy.url            # give the client this instead of the target's address
        proxy.black_hole()         # accept, never answer; live connections stall
        proxy.refuse()             # nothing listens: new connections are refused
        proxy.cut()                # live connections reset (RST) now
        proxy.pass_through()       # a working network again
        proxy.lose_replies_to(b"ComputerSystem.Reset")  # the next such request reaches the
                                   # target, and its connection is reset before any answer

Modes (`Mode`), what each does to new connections and to live ones:

- `pass`: new connections are forwarded to the target, live ones too.
- `black_hole`: new connections are accepted, held, never read nor answered (reset when the
  mode changes); live ones pause, no byte either way, until `pass` again (a partition that
  heals: their bytes wait in the kernel's buffers).
- `refuse`: nothing listens, the kernel refuses new connections (a socket bound to the port,
  not listening, keeps it meanwhile; the proxy listens on it again when the mode changes);
  live ones are left alone (`cut()` ends them).

It also records what went through: the HTTP request lines it forwarded to the target
(`requests()`, for counting a BMC's Resets or an agent's heartbeats), and `counters()`.
`flapping()` alternates `pass` with a fault on a schedule from a thread of its own and keeps
the phases it went through.

Thread-based: one acceptor thread, one thread per forwarded connection, each waking at least
every POLL_S, so a mode change applies within that and `close()` (also the context manager's
exit) ends them all, bounded. Not a test module: the chaos tests import it by name (pytest puts
tests/chaos/ on the path of the modules it collects there).
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Self

HOST = "127.0.0.1"
POLL_S = 0.05  # how often every thread of the proxy looks at the mode and at close()
CONNECT_TIMEOUT_S = 2.0  # the proxy's own connection to the target
APPLY_TIMEOUT_S = 5.0  # a mode change is applied by the acceptor within this (bounded wait)
JOIN_TIMEOUT_S = 5.0
CHUNK = 65536
REQUEST_TAIL = 4096  # bytes kept between reads to find a request line split across them
_REQUEST_LINE = re.compile(rb"\r\n(GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) (\S+) HTTP/1\.[01]\r\n")
# SO_LINGER on, 0 s: close() sends a RST instead of a FIN (a cut, not a clean close).
_RESET = struct.pack("ii", 1, 0)


class Mode(StrEnum):
    PASS = "pass"
    BLACK_HOLE = "black_hole"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class SeenRequest:
    """An HTTP request line the proxy forwarded to the target (its bytes reached the target's
    socket), and when (time.monotonic())."""

    at: float
    method: str
    path: str


@dataclass(frozen=True, slots=True)
class Counters:
    accepted: int = 0  # connections accepted (in `pass` and `black_hole`)
    forwarded: int = 0  # ... of which linked to the target
    held: int = 0  # ... of which held in a black hole, never answered
    upstream_failed: int = 0  # ... of which the target refused the proxy's own connection
    cut: int = 0  # live or held connections reset by cut(), a mode change or a lost reply
    lost_replies: int = 0  # connections reset after their request reached the target
    bytes_up: int = 0  # client → target
    bytes_down: int = 0  # target → client


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of a flap: its mode from `at` (time.monotonic()) on."""

    at: float
    mode: Mode


@dataclass
class Flap:
    """What `flapping()` did: its phases in order, each with its start."""

    phases: list[Phase] = field(default_factory=list)

    def count(self, mode: Mode) -> int:
        return sum(1 for p in self.phases if p.mode is mode)


@dataclass(slots=True)
class _LostReplies:
    marker: bytes
    left: int


def _reset(sock: socket.socket) -> None:
    """Close `sock` with a RST (the peer sees "connection reset"), whatever its state."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    with suppress(OSError):
        sock.close()


class _Link:
    """One forwarded connection: client ⇄ target, on a thread of its own."""

    def __init__(
        self, proxy: TcpFaultProxy, client: socket.socket, upstream: socket.socket
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.done = threading.Event()
        self.doomed = False  # its request's reply is to be lost (lose_replies_to)
        self._tail = b"\r\n"  # the start of the stream counts as a line break
        self.thread = threading.Thread(target=self._run, name=f"{proxy.name}-link", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def cut(self) -> None:
        """Reset both sides now (from any thread); the link's thread then ends."""
        self.done.set()
        _reset(self.client)
        _reset(self.upstream)

    def _run(self) -> None:
        open_sides = {self.client: self.upstream, self.upstream: self.client}
        try:
            while open_sides and not self.done.is_set():
                if self.proxy.mode is Mode.BLACK_HOLE:
                    self.done.wait(POLL_S)  # paused: bytes wait in the kernel's buffers
                    continue
                readable, _, _ = select.select(list(open_sides), [], [], POLL_S)
                for source in readable:
                    data = source.recv(CHUNK)
                    sink = open_sides[source]
                    if not data:  # EOF: pass the half-close on, keep the other direction
                        with suppress(OSError):
                            sink.shutdown(socket.SHUT_WR)
                        del open_sides[source]
                        continue
                    if source is self.client:
                        sink.sendall(data)
                        self._seen_up(data)
                    elif self.doomed:
                        self.proxy._count(lost_replies=1, cut=1)
                        self.cut()
                        return
                    else:
                        sink.sendall(data)
                        self.proxy._count(bytes_down=len(data))
        except OSError:
            pass  # a reset from either side, or cut() closed the sockets under us
        finally:
            self.done.set()
            for sock in (self.client, self.upstream):
                with suppress(OSError):
                    sock.close()
            self.proxy._forget(self)

    def _seen_up(self, data: bytes) -> None:
        """Count the bytes, note the request lines and whether one is to lose its reply."""
        self.proxy._count(bytes_up=len(data))
        buffer = self._tail + data
        last_end = 0
        now = time.monotonic()
        for match in _REQUEST_LINE.finditer(buffer):
            self.proxy._seen(SeenRequest(now, match[1].decode(), match[2].decode()))
            last_end = match.end() - 2  # keep the CRLF: it starts the next line
        if not self.doomed and self.proxy._take_lost_reply(self._tail, data):
            self.doomed = True
        self._tail = buffer[max(last_end, len(buffer) - REQUEST_TAIL) :]


class TcpFaultProxy:
    """A TCP proxy on 127.0.0.1 (`port`: free unless given) to `target_port` on 127.0.0.1
    (`target_host` otherwise), in `pass` mode once started. `name` names its threads."""

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = HOST,
        port: int = 0,
        name: str = "proxy",
    ) -> None:
        self.target = (target_host, target_port)
        self.name = name
        self.port = port
        self._lock = threading.Lock()
        self._mode = Mode.PASS
        self._wanted = 0  # generation of the latest mode change asked for
        self._applied = 0  # generation the acceptor has applied (listening or not)
        self._applied_cond = threading.Condition(self._lock)
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._holder: socket.socket | None = None  # keeps the port while nothing listens
        self._held: list[socket.socket] = []
        self._links: set[_Link] = set()
        self._requests: list[SeenRequest] = []
        self._counters = Counters()
        self._lost_replies: list[_LostReplies] = []
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)

    # -- life ----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Self:
        self._listener = self._listen()
        self.port = self._listener.getsockname()[1]
        self._acceptor.start()
        return self

    def close(self) -> None:
        """Stop listening, reset every connection, end every thread (bounded)."""
        self._closed.set()
        if self._acceptor.is_alive():
            self._acceptor.join(JOIN_TIMEOUT_S)
        with self._lock:
            links, self._links = list(self._links), set()
            held, self._held = self._held, []
        for sock in held:
            _reset(sock)
        for link in links:
            link.cut()
        for link in links:
            link.thread.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- faults --------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    def pass_through(self) -> None:
        self.set_mode(Mode.PASS)

    def black_hole(self) -> None:
        self.set_mode(Mode.BLACK_HOLE)

    def refuse(self) -> None:
        self.set_mode(Mode.REFUSE)

    def set_mode(self, mode: Mode) -> None:
        """From the next connection on (and for live ones, within POLL_S); returns once the
        acceptor listens or not as `mode` wants, so that a refusal holds from then on."""
        with self._lock:
            self._mode = mode
            self._wanted += 1
            wanted = self._wanted
            held = [] if mode is Mode.BLACK_HOLE else self._held
            if held:
                self._held = []
                self._counters = replace(self._counters, cut=self._counters.cut + len(held))
        for sock in held:  # a black hole's connections end when it does
            _reset(sock)
        with self._applied_cond:
            applied = self._applied_cond.wait_for(
                lambda: self._applied >= wanted or self._closed.is_set(), APPLY_TIMEOUT_S
            )
        if not applied:
            raise RuntimeError(f"{self.name}: mode {mode} not applied within {APPLY_TIMEOUT_S} s")

    def cut(self) -> int:
        """Reset every live and held connection now; how many there were."""
        with self._lock:
            links, self._links = list(self._links), set()
            held, self._held = self._held, []
            self._counters = replace(
                self._counters, cut=self._counters.cut + len(links) + len(held)
            )
        for sock in held:
            _reset(sock)
        for link in links:
            link.cut()
        return len(links) + len(held)

    def lose_replies_to(self, marker: bytes, count: int = 1) -> None:
        """The next `count` requests whose bytes hold `marker` reach the target; their
        connections are then reset at the first byte of the answer, which is never delivered
        (the request was acted on, the caller cannot know)."""
        with self._lock:
            self._lost_replies.append(_LostReplies(marker, count))

    # -- what went through ---------------------------------------------------------------------

    def requests(self, method: str | None = None, contains: str = "") -> list[SeenRequest]:
        """The request lines forwarded to the target so far, oldest first."""
        with self._lock:
            seen = list(self._requests)
        return [r for r in seen if (method is None or r.method == method) and contains in r.path]

    def counters(self) -> Counters:
        with self._lock:
            return self._counters

    def live_connections(self) -> int:
        with self._lock:
            return len(self._links) + len(self._held)

    # -- the threads' side ---------------------------------------------------------------------

    def _bound(self) -> socket.socket:
        """A socket bound to the proxy's port (any free one the first time), SO_REUSEADDR."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((HOST, self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    def _listen(self) -> socket.socket:
        listener = self._bound()
        listener.listen(128)
        return listener

    def _apply_mode(self) -> None:
        """The acceptor's side of a mode change: listen, or not (it owns the listener). While
        it refuses, a socket bound to the port and not listening keeps it: nothing else (an
        ephemeral port of some client, another test's free_port()) takes it meanwhile, and the
        listener binds it again beside that socket (both SO_REUSEADDR, neither listening)."""
        with self._lock:
            wanted, mode = self._wanted, self._mode
        if mode is Mode.REFUSE and self._listener is not None:
            self._listener.close()
            self._listener = None
            with suppress(OSError):  # taken in that instant: listening again may fail
                self._holder = self._bound()
        elif mode is not Mode.REFUSE and self._listener is None:
            try:
                self._listener = self._listen()
            except OSError:
                return  # the port is taken: tried again next round (set_mode says so in time)
            if self._holder is not None:
                self._holder.close()
                self._holder = None
        with self._applied_cond:
            self._applied = max(self._applied, wanted)
            self._applied_cond.notify_all()

    def _accept(self) -> None:
        try:
            while not self._closed.is_set():
                if self._applied < self._wanted:
                    self._apply_mode()
                listener = self._listener
                if listener is None:
                    self._closed.wait(POLL_S)
                    continue
                readable, _, _ = select.select([listener], [], [], POLL_S)
                if not readable:
                    continue
                try:
                    client, _ = listener.accept()
                except OSError:
                    continue
                self._admit(client)
        finally:
            for sock in (self._listener, self._holder):
                if sock is not None:
                    sock.close()
            self._listener = self._holder = None
            with self._applied_cond:  # nobody waits for a mode change of a closed proxy
                self._applied_cond.notify_all()

    def _admit(self, client: socket.socket) -> None:
        mode = self._mode
        if mode is Mode.REFUSE:  # accepted just before the listener closed
            _reset(client)
            return
        self._count(accepted=1)
        if mode is Mode.BLACK_HOLE:
            with self._lock:
                self._held.append(client)
                self._counters = replace(self._counters, held=self._counters.held + 1)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            self._count(upstream_failed=1)
            _reset(client)
            return
        upstream.settimeout(None)
        link = _Link(self, client, upstream)
        with self._lock:
            self._links.add(link)
            self._counters = replace(self._counters, forwarded=self._counters.forwarded + 1)
        link.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def _count(self, **increments: int) -> None:
        with self._lock:
            current = self._counters
            self._counters = replace(
                current, **{k: getattr(current, k) + v for k, v in increments.items()}
            )

    def _seen(self, request: SeenRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def _take_lost_reply(self, before: bytes, data: bytes) -> bool:
        """Whether a marker of a rule with replies left to lose ends in `data` (it may begin
        in `before`, the bytes that came just before); if so, that rule has one fewer."""
        with self._lock:
            for rule in self._lost_replies:
                overlap = before[len(before) - len(rule.marker) + 1 :] if rule.marker else b""
                if rule.left > 0 and rule.marker in overlap + data:
                    rule.left -= 1
                    return True
        return False


@contextmanager
def flapping(
    proxy: TcpFaultProxy,
    *,
    up_s: float,
    down_s: float,
    down: Mode = Mode.BLACK_HOLE,
    cut_on_down: bool = True,
    start_down: bool = False,
) -> Iterator[Flap]:
    """Alternate `pass` (`up_s`) with `down` (`down_s`) from a thread of its own until the
    block ends; then `pass` again. `cut_on_down`: live connections are reset as each down
    phase begins (a BMC that reboots), not only stalled or left alone."""
    if up_s <= 0 or down_s <= 0 or down is Mode.PASS:
        raise ValueError("a flap needs positive phases and a fault for its down phase")
    record = Flap()
    stop = threading.Event()

    def run() -> None:
        is_down = start_down
        while not stop.is_set():
            mode = down if is_down else Mode.PASS
            proxy.set_mode(mode)
            if is_down and cut_on_down:
                proxy.cut()
            record.phases.append(Phase(time.monotonic(), mode))
            stop.wait(down_s if is_down else up_s)
            is_down = not is_down

    thread = threading.Thread(target=run, name=f"{proxy.name}-flap", daemon=True)
    thread.start()
    try:
        yield record
    finally:
        stop.set()
        thread.join(JOIN_TIMEOUT_S + max(up_s, down_s))
        proxy.pass_through()
        record.phases.append(Phase(time.monotonic(), Mode.PASS))
