"""The control store interface (:class:`Store`), and hosting of and connections to torch ``TCPStore`` servers
(its c10d implementation, :class:`C10dStore`), with errors a user can act on. The etcd implementation is in
:mod:`ftrun.control.etcd`.

The control store of a job and each generation's trainer store are plain ``torch.distributed.TCPStore``
servers. Connecting is done in two stages so that failures are bounded and readable: first a plain TCP
probe until the endpoint accepts (unreachable -> :class:`UsageError` after ``timeout``), then the store
handshake in a helper thread with a deadline (a port held by something that is not a store never answers).

Binding: torch's server listens on every interface by itself, so :func:`host_store` binds the listening socket
itself (to one address, :data:`LOOPBACK` unless told otherwise) and hands it to torch (``master_listen_fd``).
Local jobs bind every store to :data:`LOOPBACK`; multi-node jobs to ``--rdzv-bind``, by default the address
of the interface that reaches the control store's host (:func:`route_address`), 0.0.0.0 only when asked.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import psutil
from torch.distributed import DistError, DistStoreError, TCPStore

from ftrun.errors import UsageError

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")

ABSENT = b"\x00ftrun: no such key\x00"  # never a stored value: values are signed (see C10dStore)
# Store operations (get/wait) that outlive this are errors; the job itself only uses non-blocking calls.
STORE_OP_TIMEOUT = timedelta(seconds=60)
# C10dStore.wait's rounds: long, since each one that ends unanswered prints two C++ warnings (up to 24.8 days fit
# the socket's millisecond timeout)
_WAIT_ROUND = timedelta(days=1)
OUTAGE_NOTICE = 2.0  # seconds an operation goes unanswered before on_outage is told (as etcd's)
WAIT_NOTICE = 3.0  # seconds a launcher waits for an unreachable control store before it says so
# TCP's longest pause between two resends on a control-store connection (see bound_resends); 1000 is the least
RESEND_MAX_MS = 1000
TCP_RTO_MAX_MS = getattr(socket, "TCP_RTO_MAX_MS", 44)  # Linux >= 6.15 (Python 3.12's socket does not name it)
_HANDSHAKE_TIMEOUT = 5.0


class Store(Protocol):
    """The raw key-value operations the control plane uses (values are bytes; :class:`~ftrun.control.signed.
    SignedStore` signs and checks them). Every call is one short round trip (a few for many keys) and never waits
    for a key to appear. A store that cannot be reached for good raises ``torch.distributed.DistError``.

    ``poll_interval``: the shortest interval at which a process should poll the store for changes (seconds; 0:
    as often as the caller needs). A TCPStore answers in tens of microseconds; an etcd read costs a linearizable
    round trip through the leader and about 0.7 ms of client CPU, so its callers poll at most ten times a second.
    ``op_timeout``: the longest one operation waits for a store that does not answer before it raises.
    """

    poll_interval: float
    op_timeout: float

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key, None for a key that is not set."""

    def compare_set(self, key: str, expected: bytes, value: bytes) -> bytes:
        """Store ``value`` if ``key`` holds exactly ``expected`` (b"": not set); the bytes ``key`` holds now."""

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set."""

    def close(self) -> None:
        """Drop the connection (a hosted server stops with its owner)."""


class C10dStore:
    """:class:`Store` over a torch ``TCPStore`` (a client, or the server's own client).

    A read of keys that may be missing cannot use ``multi_get`` (it waits for them): each key is read with
    ``compare_set(key, ABSENT, ABSENT)``, which answers ``ABSENT`` for a missing key and the value for a present
    one (whose value is never ``ABSENT``) without waiting and without writing: one round trip per key.

    Every operation but :meth:`wait` ends within ``op_timeout`` seconds: torch's client waits forever for a server
    that accepted the request and never answers (its host frozen, SIGSTOP, or cut off without a reset), and its own
    timeout bounds only waits for keys. A watchdog thread (started with the first operation) shuts down this
    process's connections to the server when one operation outlives it, so that operation (and every later one)
    raises ``DistError``, as for a store that is gone. An operation unanswered for :data:`OUTAGE_NOTICE` seconds
    is told to ``on_outage`` (one line: the job pauses), and its answer to ``on_recovered``, as etcd's are; one that
    fails instead (the store gone meanwhile) is no answer: it is told to ``on_failed``, not to ``on_recovered``."""

    poll_interval = 0.0

    def __init__(self, store: TCPStore, op_timeout: float = STORE_OP_TIMEOUT.total_seconds(),
                 on_outage: Callable[[str], None] | None = None,
                 on_recovered: Callable[[float], None] | None = None,
                 on_failed: Callable[[], None] | None = None) -> None:
        self.tcp = store
        self.op_timeout = op_timeout
        self.unanswered = False  # the watchdog cut the connections: the server did not answer in time
        self._began: dict[int, float] = {}  # thread -> when its operation began
        self._reported: set[int] = set()  # threads whose operation was told to on_outage
        self._lock = threading.Lock()
        self._on_outage, self._on_recovered, self._on_failed = on_outage, on_recovered, on_failed
        self._watchdog: threading.Thread | None = None

    def _call(self, operation: Callable[..., Any], *args: Any) -> Any:
        thread = threading.get_ident()
        self._began[thread] = time.monotonic()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="ftrun-store-watchdog", daemon=True)
            self._watchdog.start()
        answered = False
        try:
            result = operation(*args)
            answered = True
            return result
        except DistError as err:
            if self.unanswered:
                raise DistError(f"the control store at {self.tcp.host}:{self.tcp.port} did not answer for "
                                f"{self.op_timeout:g}s (its host frozen, or cut off)") from err
            raise
        finally:
            with self._lock:
                began = self._began.pop(thread)
                reported = thread in self._reported
                self._reported.discard(thread)
            if reported and answered and self._on_recovered is not None and not self.unanswered:
                self._on_recovered(time.monotonic() - began)
            elif reported and self._on_failed is not None:
                self._on_failed()

    def _watch(self) -> None:
        interval = min(OUTAGE_NOTICE / 2, self.op_timeout / 4)
        looked = time.monotonic()
        while not self.unanswered:
            time.sleep(interval)
            now = time.monotonic()
            away = now - looked > 2 * interval + 1.0  # this process was stopped: not the store's fault
            looked = now
            with self._lock:
                late = [(thread, began) for thread, began in self._began.items()
                        if now - began > OUTAGE_NOTICE and not away and thread not in self._reported]
                self._reported.update(thread for thread, _ in late)
            for _, began in late if self._on_outage is not None else []:  # one call per operation, as recovered
                self._on_outage(f"the control store at {self.tcp.host}:{self.tcp.port} has not answered for "
                                f"{now - began:.0f}s; ftrun waits up to {self.op_timeout:g}s for it")
            if any(now - began > self.op_timeout for began in list(self._began.values())):
                self.unanswered = True
                cut_connections(self.tcp.host, self.tcp.port)

    def set(self, key: str, value: bytes) -> None:
        self._call(self.tcp.set, key, value)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = list(keys)
        if not keys:
            return []
        if len(keys) > 2 and self._call(self.tcp.check, keys):  # two round trips (multi_get waits for missing keys)
            return [bytes(value) for value in self._call(self.tcp.multi_get, keys)]
        values = [bytes(self._call(self.tcp.compare_set, key, ABSENT, ABSENT)) for key in keys]
        return [None if value == ABSENT else value for value in values]

    def compare_set(self, key: str, expected: bytes, value: bytes) -> bytes:
        return bytes(self._call(self.tcp.compare_set, key, expected, value))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call(self.tcp.check, list(keys)))

    def wait(self, key: str) -> None:
        """Block until ``key`` is set: the server answers the moment it is, no polling. It holds the connection
        meanwhile: only on a connection of its own. Raises ``DistError`` when the store is gone.

        The server also answers a wait when anyone reads the missing key as :meth:`get_many` does (a
        ``compare_set`` that writes nothing still wakes the key's waiters), so an answer is checked: a key still
        missing is waited for again."""
        while True:
            try:
                self.tcp.wait([key], _WAIT_ROUND)
            except DistStoreError as err:  # the round is over, the key not set (the connection stays usable)
                if "timeout" not in str(err):
                    raise
                continue
            if self.tcp.check([key]):
                return

    def close(self) -> None:
        """Nothing to do: torch closes the connection when the store object goes."""


def _connections_to(host: str, port: int) -> Iterator[socket.socket]:
    """A duplicate of each TCP connection of this process to ``host:port`` (what is done to a duplicate is done to
    the connection; the caller closes the duplicate)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except OSError:
        addresses = {host}
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port == port and conn.raddr.ip.removeprefix("::ffff:") in addresses:
            try:
                yield socket.socket(fileno=os.dup(conn.fd))
            except OSError:  # closed meanwhile
                pass


def cut_connections(host: str, port: int) -> None:
    """Shut down (both ways) every TCP connection of this process to ``host:port``; a thread blocked reading one
    returns at once."""
    for sock in _connections_to(host, port):
        with sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass


def bound_resends(sock: socket.socket) -> None:
    """Resend what ``sock`` sent and got no answer for at least every :data:`RESEND_MAX_MS` milliseconds, however
    long it went unanswered (``TCP_RTO_MAX_MS``; a listening socket's connections inherit it). TCP doubles the
    pause between resends from 0.2 s (1 s for a connection's first packet) up to 2 minutes, so a host cut off for c
    seconds, packets dropped without a word on the way, heard nothing of its supervisor's beats for up to about
    2c (a 4 s cut: 6.2 s): its node was declared lost for a cut well within ``--node-timeout``. Bounded, the beats
    get through within a second of the network's return. A kernel without the option (before Linux 6.15) keeps
    TCP's doubling."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RESEND_MAX_MS)
    except OSError:  # ENOPROTOOPT: an older kernel
        pass


def host_store(port: int, what: str = "control store", bind: str = LOOPBACK,
               flag: str = "--rdzv-endpoint") -> TCPStore:
    """Start a store server listening on ``bind``:``port`` only (port 0: any free port; ``bind`` 0.0.0.0: every
    interface); a port in use is a :class:`UsageError` that names ``flag``, the setting that chose the port."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound_resends(sock)
        sock.bind((bind, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UsageError(f"{what} port {port} is already in use (choose another with {flag})") from None
        raise UsageError(f"cannot start the {what} on {bind}:{port}: {err.strerror}") from None
    client = (LOOPBACK if family == socket.AF_INET else "::1") if bind in WILDCARDS else bind
    bound = sock.getsockname()[1]
    try:  # the store owns the descriptor from here on (it closes it when it goes)
        return TCPStore(client, bound, is_master=True, wait_for_workers=False, timeout=STORE_OP_TIMEOUT,
                        master_listen_fd=sock.detach())
    except DistError as err:
        raise UsageError(f"cannot start the {what} on {bind}:{bound}: {str(err).splitlines()[0]}") from None


def route_address(host: str, port: int) -> str:
    """The local address this host uses to reach ``host:port`` (a UDP socket connected to it; nothing is sent):
    loopback for a local endpoint, else the address of the interface on the way."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as err:
        raise UsageError(f"cannot find the local address that reaches {host}:{port}: "
                         f"{err.strerror or err}") from None


def check_bind_address(address: str, flag: str = "--rdzv-bind") -> str:
    """``address`` as an IP this host can listen on (an address of one of its interfaces, any loopback, or a
    wildcard); anything else is a :class:`UsageError`."""
    if address in WILDCARDS:
        return address or "0.0.0.0"
    try:
        resolved = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        raise UsageError(f"{flag} {address!r} does not resolve") from None
    ip = ipaddress.ip_address(resolved.split("%")[0])
    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    if not (ip.is_loopback or ip.is_unspecified or str(ip) in local):
        raise UsageError(f"{flag} {address} is not an address of this host (its addresses: "
                         f"{', '.join(sorted(a for a in local if ':' not in a)) or 'none'})")
    return str(ip)


def wait_until_reachable(host: str, port: int, timeout: float, waiting: Callable[[str], None] | None = None) -> None:
    """Return once ``host:port`` accepts TCP connections; raise :class:`UsageError` after ``timeout``. After
    :data:`WAIT_NOTICE` seconds without it, ``waiting`` is told once (one line: what, why, until when)."""
    start = time.monotonic()
    deadline, told = start + timeout, waiting is None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            reason = err.strerror or str(err)
            if time.monotonic() >= deadline:
                raise UsageError(f"control store at {host}:{port} is unreachable after {timeout:g}s "
                                 f"({reason})") from None
            if not told and time.monotonic() - start >= WAIT_NOTICE:
                told = True
                assert waiting is not None
                waiting(f"waiting for the control store at {host}:{port} ({reason}); giving up {timeout:g}s after "
                        "the start (--rdzv-timeout)")
            time.sleep(0.1)


def connect_store(host: str, port: int, timeout: float, waiting: Callable[[str], None] | None = None) -> TCPStore:
    """A client of the store at ``host:port``, waiting up to ``timeout`` seconds for it to come up (``waiting``:
    see :func:`wait_until_reachable`)."""
    wait_until_reachable(host, port, timeout, waiting)
    result: list[TCPStore | BaseException] = []

    def handshake() -> None:
        try:
            result.append(TCPStore(host, port, is_master=False, timeout=STORE_OP_TIMEOUT))
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            result.append(err)

    thread = threading.Thread(target=handshake, name="ftrun-store-connect", daemon=True)
    thread.start()
    thread.join(_HANDSHAKE_TIMEOUT)
    if not result:
        raise UsageError(f"{host}:{port} accepts connections but is not a torch TCPStore (no handshake "
                         f"within {_HANDSHAKE_TIMEOUT:g}s): is the port used by another program?")
    if isinstance(result[0], BaseException):
        raise UsageError(f"cannot connect to the control store at {host}:{port}: {str(result[0]).splitlines()[0]}")
    for sock in _connections_to(host, port):  # torch's, and any this process made before (bounding is idempotent)
        with sock:
            bound_resends(sock)
    return result[0]
