"""Keeper-to-keeper TCP transport: authenticated, framed, bounded request/reply; no torch, nothing unpickled.

Protocol (version 1; all integers big-endian):

1. Handshake, mutual, proving knowledge of the job's secret (>= 16 bytes) without sending it:

   - server -> client: ``b"FTRK"`` + version (u8) + ``nonce_s`` (32 random bytes)
   - client -> server: ``nonce_c`` (32 random bytes) + ``HMAC-SHA256(secret, b"client" + nonce_s + nonce_c)``
   - server -> client: ``HMAC-SHA256(secret, b"server" + nonce_c + nonce_s)``

   Each side checks the other's MAC with :func:`hmac.compare_digest` and closes the connection on any mismatch;
   the server answers only a client that proved itself first. The server bounds the whole handshake by
   ``handshake_timeout`` seconds. This authenticates the peers only: the frames that follow are neither
   encrypted nor integrity-protected (the cluster network is trusted not to tamper with them).

2. Then frames, the same format in both directions: header ``struct "!4sIQ"`` = (``b"FTRF"``, json_len u32,
   payload_len u64), json_len bytes of UTF-8 JSON that must decode to an object, then payload_len raw bytes.
   json_len <= :data:`MAX_JSON`; payload_len <= the receiver's ``max_payload`` (at most :data:`MAX_PAYLOAD`).
   A frame that breaks a rule closes its connection and nothing of it is acted on.

3. The client sends a request ``{"op": str, ...}``, with a payload up to the server's ``max_payload``: the
   server's ``sink`` names the memory it is received into (without a sink it is read and dropped). The server
   answers one reply per request, in order: the handler's fields and payload, or ``{"error": "<type>:
   <message>"}`` when the sink or the handler failed. A connection carries one request at a time, so a reply
   always belongs to the last request sent on it. A client that knows the payload length it asked for (a range of
   bytes, none) refuses a reply announcing another from its header, before receiving or allocating any of it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, BinaryIO

VERSION = 1
HANDSHAKE_MAGIC = b"FTRK"
FRAME_MAGIC = b"FTRF"
NONCE_LEN = 32
MAC_LEN = 32
MIN_SECRET_LEN = 16
HELLO = struct.Struct("!4sB32s")
FRAME = struct.Struct("!4sIQ")
MAX_JSON = 64 << 10
MAX_PAYLOAD = 512 << 20
MAX_ERROR_LEN = 4096  # an error reply's message is cut to this many characters
HANDSHAKE_TIMEOUT = 5.0
LISTEN_BACKLOG = 128
IDLE_CONNECTIONS = 4  # idle connections a PeerPool keeps per peer
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}  # drops a vanished peer in ~1 min
BUSY_BACKOFF = (0.01, 0.5)  # first and longest pause before connecting again to a peer that was at its limit


class PeerUnavailable(ConnectionError):
    """No answer from the peer: connect, I/O or authentication failure, timeout, closed or invalid reply."""


class PeerBusy(PeerUnavailable):
    """The peer's server closed new connections before greeting them (it was at ``max_connections``) for as long
    as the client's ``timeout``: the keeper is alive but refused."""


class PeerError(RuntimeError):
    """The peer answered the request with an error."""


class PeerWrongLength(PeerError):
    """The peer answered with a payload of another length than the request asked for: refused before any of it was
    received (nothing allocated for it), the connection closed. A wrong answer, not a lost peer."""


class _Violation(Exception):
    """The other end broke the protocol (or left mid-message); its connection must be closed."""


class _WrongLength(_Violation):
    """A reply's payload is not of the length its request asked for."""


class _Refused(_Violation):
    """The server closed the connection before its greeting: what it does beyond its ``max_connections``."""


class _ClosedEarly(_Violation):
    """The peer closed the connection before the frame it was sending ended, or before its reply began."""


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes of the file at ``path`` from ``offset``, sent from the file with ``sendfile`` (no copy)."""

    path: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"negative offset or length in {self}")


Piece = FileRange | bytes | bytearray | memoryview
Buffer = bytes | bytearray | memoryview


@dataclass
class Reply:
    """A handler's answer: JSON ``fields`` and a payload, whose pieces go on the wire one after the other."""

    fields: dict[str, Any]
    payload: Piece | list[Piece] = b""


Handler = Callable[[dict[str, Any]], Reply]
# (request fields, payload length) -> (writable view of exactly that length, done(received whole))
Sink = Callable[[dict[str, Any], int], tuple[memoryview, Callable[[bool], None]]]
DISCARD_CHUNK = 1 << 20
_Outgoing = list[tuple[BinaryIO, int, int] | memoryview]


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_LEN:
        raise ValueError(f"the job secret must have at least {MIN_SECRET_LEN} bytes")


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> int:
    """Fills ``view``; returns the bytes received, fewer than ``len(view)`` only if the peer closed first.

    On a blocking socket each call waits for the whole rest (``MSG_WAITALL``): a payload of megabytes arrives in
    one system call, without taking the GIL back per socket buffer (pyeclib holds it while it codes a piece)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL if sock.gettimeout() is None else 0)
        if n == 0:
            break
        got += n
    return got


def _timeval(seconds: float) -> bytes:
    """A bound on each blocking receive or send of a socket (``SO_RCVTIMEO``, ``SO_SNDTIMEO``: a receive that waits
    longer fails with EAGAIN, one that got part of its bytes returns them)."""
    seconds = max(seconds, 1e-3)  # a zero timeval means no bound
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _recv_all(sock: socket.socket, size: int, what: str, deadline: float | None = None) -> bytearray:
    buf = bytearray(size)
    if _recv_exact(sock, memoryview(buf), deadline) < size:
        raise _ClosedEarly(f"connection closed during the {what}")
    return buf


def _recv_head(sock: socket.socket, max_payload: int) -> tuple[dict[str, Any], int] | None:
    """The next frame's JSON object and payload length (its payload is still to be read); None on a clean
    close."""
    header = bytearray(FRAME.size)
    got = _recv_exact(sock, memoryview(header))
    if got == 0:
        return None
    if got < FRAME.size:
        raise _ClosedEarly("connection closed during a frame header")
    magic, json_len, payload_len = FRAME.unpack(header)
    if magic != FRAME_MAGIC:
        raise _Violation(f"bad frame magic {bytes(magic)!r}")
    if json_len > MAX_JSON:
        raise _Violation(f"frame JSON of {json_len} bytes exceeds {MAX_JSON}")
    if payload_len > max_payload:
        raise _Violation(f"frame payload of {payload_len} bytes exceeds {max_payload}")
    try:
        fields = json.loads(_recv_all(sock, json_len, "frame JSON").decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Violation(f"frame JSON does not parse: {exc}") from exc
    if not isinstance(fields, dict):
        raise _Violation(f"frame JSON is a {type(fields).__name__}, not an object")
    return fields, payload_len


def _recv_frame(
    sock: socket.socket, max_payload: int, into: memoryview | None = None, length: int | None = None
) -> tuple[dict[str, Any], bytes | int] | None:
    """The next frame's JSON object and payload (its length when received ``into``); None on a clean close. With
    ``length``, a frame that is not an error reply and announces another payload length is refused before any of
    its payload is received."""
    head = _recv_head(sock, max_payload)
    if head is None:
        return None
    fields, payload_len = head
    if length is not None and payload_len != length and "error" not in fields:
        raise _WrongLength(f"a reply of {payload_len} bytes to a request for {length}")
    if into is None:
        return fields, bytes(_recv_all(sock, payload_len, "frame payload"))
    if payload_len > len(into):
        raise _Violation(f"frame payload of {payload_len} bytes exceeds the {len(into)}-byte buffer")
    if _recv_exact(sock, into[:payload_len]) < payload_len:
        raise _ClosedEarly("connection closed during the frame payload")
    return fields, payload_len


def _discard(sock: socket.socket, length: int) -> None:
    """Read and drop ``length`` payload bytes (a request whose payload has no place)."""
    buffer = memoryview(bytearray(min(length, DISCARD_CHUNK)))
    while length > 0:
        n = min(length, len(buffer))
        if _recv_exact(sock, buffer[:n]) < n:
            raise _ClosedEarly("connection closed during the frame payload")
        length -= n


def _prepare(fields: dict[str, Any], payload: Piece | list[Piece], files: ExitStack) -> tuple[bytes, _Outgoing]:
    """The frame's header and JSON, and its payload pieces with their files opened (closed by ``files``).

    Everything that can fail short of the socket itself (encoding, limits, files missing or too short) fails
    here, before a byte is sent, so a caller can still answer with an error frame instead.
    """
    pieces: _Outgoing = []
    total = 0
    for piece in payload if isinstance(payload, list) else [payload]:
        if isinstance(piece, FileRange):
            file = files.enter_context(open(piece.path, "rb", buffering=0))
            if piece.offset + piece.length > os.fstat(file.fileno()).st_size:
                raise ValueError(f"{piece} extends past the end of the file")
            if piece.length:  # sendfile would read a zero count as "to the end of the file"
                pieces.append((file, piece.offset, piece.length))
            total += piece.length
        else:
            view = memoryview(piece)
            pieces.append(view)
            total += view.nbytes
    return _head(fields, total), pieces


def _head(fields: dict[str, Any], payload_len: int) -> bytes:
    """A frame's header and JSON; raises if ``fields`` does not encode or a limit is exceeded."""
    if not isinstance(fields, dict):
        raise TypeError(f"frame fields must be a dict, not {type(fields).__name__}")
    body = json.dumps(fields, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_JSON:
        raise ValueError(f"frame JSON of {len(body)} bytes exceeds {MAX_JSON}")
    if payload_len > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {payload_len} bytes exceeds {MAX_PAYLOAD}")
    return FRAME.pack(FRAME_MAGIC, len(body), payload_len) + body


def _send(sock: socket.socket, head: bytes, pieces: _Outgoing) -> None:
    """Sends a frame on a blocking socket. With a send timeout (``SO_SNDTIMEO``) each system call waits that long for
    the peer to take some bytes, then raises BlockingIOError (``socket.sendfile`` would wait on for good)."""
    sock.sendall(head)
    for piece in pieces:
        if isinstance(piece, memoryview):
            sock.sendall(piece)
            continue
        file, offset, length = piece
        end = offset + length
        while offset < end:
            sent = os.sendfile(sock.fileno(), file.fileno(), offset, end - offset)
            if sent == 0:
                raise OSError(f"{file.name} shrank while it was being sent")
            offset += sent


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_LEN]


class PeerServer:
    """Answers authenticated peers' requests with ``handler``, one daemon thread per connection.

    A handler exception becomes an error reply and the connection stays open. A connection that fails the
    handshake, breaks the framing or exceeds a limit is closed and reported through ``on_event`` (one line
    naming the peer); other and later connections are unaffected. Beyond ``max_connections`` authenticated
    connections a new one is closed at once (before its greeting). Connections still in their handshake are
    bounded on their own: beyond ``max_connections`` of them a new one evicts the oldest, and one that has not
    completed the handshake after ``handshake_timeout`` seconds is dropped; so whoever reaches the port without
    the secret (silent or slow connections, opened as fast as they are dropped) never locks the peers out, whose
    handshakes take one round trip. Any other error of a connection's thread (a bug of the server, its handler or
    its sink) closes that connection and is reported in one line; the server goes on. The socket is bound at
    construction (``address``), served by :meth:`serve` (in a thread of the caller's) or :meth:`start`.
    ``on_event`` runs on server threads; an exception from it is ignored.

    ``sink(fields, length)`` gives the memory a request's payload is received into and a ``done`` callback,
    called once the payload is in (True) or the connection failed during it (False); ``done`` is called
    whenever ``sink`` returned. A sink that raises makes the request an error reply (its payload is dropped).
    A request that stops arriving midway for ``timeout`` seconds, in its header, JSON or payload (a peer stopped
    mid-request, whose kernel keeps the connection open), closes the connection: a sink's ``done`` comes within one
    to two timeouts, never waits for the peer; a connection idle between requests stays open. So does a reply the
    peer takes none of for ``timeout`` seconds (a peer that stopped reading, or whose host is gone): a connection's
    thread never waits on its peer for good, nor holds a place among ``max_connections`` beyond that.
    """

    def __init__(
        self,
        secret: bytes,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        on_event: Callable[[str], None] | None = None,
        max_payload: int = MAX_PAYLOAD,
        max_connections: int = 64,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        listener: socket.socket | None = None,
        sink: Sink | None = None,
        timeout: float = 30.0,
    ) -> None:
        _check_secret(secret)
        self.secret = secret
        self.handler = handler
        self.sink = sink
        self.timeout = timeout
        self.on_event = on_event
        self.max_payload = min(max_payload, MAX_PAYLOAD)
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        # ``listener``: an already listening socket (a keeper restarted by its supervisor inherits one)
        self._listener = listener or socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # every open one (closed by close())
        self._pending: dict[socket.socket, None] = {}  # those in their handshake, oldest first
        self._serving: set[socket.socket] = set()  # those authenticated
        self._closed = False
        self._accepting = threading.Lock()  # held by serve() while it runs

    def start(self) -> None:
        """:meth:`serve` in a daemon thread of its own (an unexpected error ends it with a traceback)."""
        threading.Thread(target=self.serve, name="ftrun-peer-server", daemon=True).start()

    def close(self) -> None:
        """Stops accepting and shuts every open connection down (their threads then close them); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        with self._accepting:  # serve() has returned
            pass

    def _report(self, message: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(message)
            except Exception:
                pass

    def serve(self) -> None:
        """Accept connections, each served by a daemon thread of its own, until :meth:`close`. A connection that
        cannot be accepted or given its thread (out of file descriptors or threads) is reported, and the next one
        accepted after a pause. Any other error is a bug and raised: the caller must not go on as if peers were
        served (the keeper exits for its supervisor to restart it, :meth:`Keeper._background
        <ftrun.snapshot.keeper.Keeper._background>`)."""
        with self._accepting:
            self._accept_loop()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                self._pause(f"accept failed: {exc}")
                continue
            peer = f"{addr[0]}:{addr[1]}"
            evicted = None
            with self._lock:
                if len(self._serving) >= self.max_connections:
                    self._forget_closed()
                admitted = not self._closed and len(self._serving) < self.max_connections
                if admitted:
                    if len(self._pending) >= self.max_connections:
                        evicted = next(iter(self._pending))
                        del self._pending[evicted]
                    self._connections.add(conn)
                    self._pending[conn] = None
            if evicted is not None:  # its thread sees the connection end, says so and closes it
                try:
                    evicted.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if not admitted:
                conn.close()
                if not self._closed:
                    self._report(f"peer {peer}: refused, {self.max_connections} connections already open")
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer), name=f"ftrun-peer-{peer}",
                                 daemon=True).start()
            except RuntimeError as exc:  # can't start new thread
                self._forget(conn)
                self._pause(f"peer {peer}: {exc}; connection closed")

    def _pause(self, message: str) -> None:
        """Report a connection that could not be taken in, then give those open a moment to end (and free their
        descriptors or threads)."""
        self._report(f"peer server {self.address[0]}:{self.address[1]}: {message}")
        time.sleep(0.1)

    def _forget_closed(self) -> None:
        """Forget the connections their peers have closed, whose threads have not yet seen it (under the lock): a
        pool that just replaced some of its connections is not refused for ones already gone."""
        for conn in list(self._serving):
            try:
                if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self._serving.discard(conn)
            except (BlockingIOError, InterruptedError):  # open, nothing to read
                pass
            except OSError:  # reset, or closed by its thread meanwhile
                self._serving.discard(conn)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            try:
                self._handshake(conn)
            except (_Violation, OSError):
                with self._lock:
                    evicted = not self._closed and conn not in self._pending
                if evicted:
                    raise _Violation(f"evicted in its handshake by {self.max_connections} newer ones") from None
                raise
            conn.settimeout(None)
            with self._lock:  # evicted just now: shut down, so its next read ends it
                self._pending.pop(conn, None)
                self._serving.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))  # bounds replies (_send)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout))  # and requests begun
            for option, value in KEEPALIVE.items():
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
            while (request := self._receive(conn)) is not None:
                self._answer(conn, *request)
        except _Violation as exc:
            self._report(f"peer {peer}: {exc}; connection closed")
        except TimeoutError:
            self._report(f"peer {peer}: handshake not completed within {self.handshake_timeout:g}s; connection closed")
        except OSError as exc:
            if not self._closed:
                self._report(f"peer {peer}: {exc}; connection closed")
        except Exception as exc:  # noqa: BLE001 - a bug of the server, its handler or its sink: this connection ends
            self._report(f"peer {peer}: internal error ({_describe(exc)}); connection closed")
        finally:
            self._forget(conn)

    def _forget(self, conn: socket.socket) -> None:
        """Close ``conn`` and drop it from every set of connections."""
        with self._lock:
            self._connections.discard(conn)
            self._pending.pop(conn, None)
            self._serving.discard(conn)
        conn.close()

    def _handshake(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.handshake_timeout
        conn.settimeout(self.handshake_timeout)
        nonce_s = secrets.token_bytes(NONCE_LEN)
        conn.sendall(HELLO.pack(HANDSHAKE_MAGIC, VERSION, nonce_s))
        answer = bytes(_recv_all(conn, NONCE_LEN + MAC_LEN, "handshake", deadline))
        nonce_c, proof = answer[:NONCE_LEN], answer[NONCE_LEN:]
        if not hmac.compare_digest(proof, _mac(self.secret, b"client", nonce_s, nonce_c)):
            raise _Violation("authentication failed")
        conn.settimeout(max(deadline - time.monotonic(), 1e-3))
        conn.sendall(_mac(self.secret, b"server", nonce_c, nonce_s))

    def _receive(self, conn: socket.socket) -> tuple[dict[str, Any], str | None] | None:
        """The next request and why its payload has no place (None: it has); None when the peer closed the
        connection. Between two requests a connection idles at will; a request begun that then pauses for
        ``timeout`` seconds (``SO_RCVTIMEO``), in its header, JSON or payload, closes it."""
        while True:
            try:
                if conn.recv(1, socket.MSG_PEEK) == b"":
                    return None
                break
            except BlockingIOError:  # idle for ``timeout`` seconds: no request begun, nothing stalled
                continue
        try:
            head = _recv_head(conn, self.max_payload)
            return None if head is None else (head[0], self._take_payload(conn, *head))
        except BlockingIOError:  # nothing more of the request for ``timeout`` seconds
            raise _Violation(f"request stalled for {self.timeout:g}s") from None

    def _take_payload(self, conn: socket.socket, fields: dict[str, Any], length: int) -> str | None:
        """Receives a request's payload where the sink says (else drops it); returns why it has no place."""
        if length == 0:
            return None
        if self.sink is None:
            _discard(conn, length)
            return None
        try:
            view, done = self.sink(fields, length)
        except Exception as exc:
            _discard(conn, length)
            return _describe(exc)
        received = False
        try:
            if len(view) != length:
                _discard(conn, length)
                return f"ValueError: the sink gave {len(view)} bytes for a payload of {length}"
            got = _recv_exact(conn, view)
            if got < length:
                raise _ClosedEarly("connection closed during the frame payload")
            received = True
            return None
        finally:
            view.release()
            done(received)

    def _answer(self, conn: socket.socket, request: dict[str, Any], refused: str | None = None) -> None:
        with ExitStack() as files:
            try:
                if refused is not None:
                    reply = Reply({"error": refused})
                elif not isinstance(request.get("op"), str):
                    raise ValueError("the request has no op")
                else:
                    reply = self.handler(request)
                head, pieces = _prepare(reply.fields, reply.payload, files)
            except Exception as exc:
                head, pieces = _prepare({"error": _describe(exc)}, b"", files)
            try:
                _send(conn, head, pieces)
            except BlockingIOError:  # nothing taken for ``timeout`` seconds (SO_SNDTIMEO)
                raise _Violation(f"took none of its reply for {self.timeout:g}s") from None


class PeerClient:
    """One connection to a peer's :class:`PeerServer`, opened at the first request and after any failure.

    Any connection, I/O, timeout, authentication or framing failure closes the connection and raises
    :class:`PeerUnavailable`; an error reply raises :class:`PeerError` and keeps it. Requests from several
    threads are serialized. ``timeout`` bounds each blocking socket operation, not the whole request.

    Two failures are not taken for a lost peer. A server at its ``max_connections`` closes a new connection
    before its greeting: the client connects again after a pause (:data:`BUSY_BACKOFF`, doubling) until
    ``timeout`` has passed, then raises :class:`PeerBusy`. A connection the peer closed or reset before its reply
    ended (a kept one it closed while idle, a middlebox that dropped it, a keeper that restarted its server in the
    middle of a reply, a reset on the way) is replaced by a new one at once, and the request sent again, once: every
    request is a read or the write of the same bytes again, and a peer that is gone refuses the new connection (or
    stays silent), which raises as before. A timeout is neither: a silent peer costs ``timeout`` once, not twice.
    """

    def __init__(
        self, host: str, port: int, secret: bytes, timeout: float = 30.0, max_payload: int = MAX_PAYLOAD
    ) -> None:
        _check_secret(secret)
        self.host = host
        self.port = port
        self.secret = secret
        self.timeout = timeout
        self.max_payload = min(max_payload, MAX_PAYLOAD)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def request(self, op: str, into: memoryview | None = None, payload: Buffer | None = None,
                reply_len: int | None = None, **fields: Any) -> tuple[dict[str, Any], bytes | int]:
        """Sends one request, with ``payload`` bytes after it if given; returns (reply fields, payload).

        With ``into`` (a writable buffer), the payload is received straight into it with ``recv_into`` (no extra
        copy) and the second item is the number of bytes received; a payload longer than ``into`` is a
        :class:`PeerUnavailable` (the connection is closed). Raises :class:`PeerError` for an error reply.
        ``reply_len``: the payload length the request asks for (a range of bytes, none); a reply announcing
        another is :class:`PeerWrongLength`, before any of its payload is received or memory allocated for it.
        """
        view = None if into is None else memoryview(into).cast("B")
        if view is not None and view.readonly:
            raise ValueError("into must be a writable buffer")
        body = memoryview(payload if payload is not None else b"").cast("B")
        head = _head({"op": op, **fields}, body.nbytes)
        with self._lock:
            try:
                try:
                    reply = self._exchange(head, body, view, reply_len)
                except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, _ClosedEarly):
                    self._close()  # reset, or closed before the reply ended: one more try on a new connection
                    reply = self._exchange(head, body, view, reply_len)
            except _WrongLength as exc:
                self._close()
                raise PeerWrongLength(f"keeper {self.host}:{self.port}: {exc}") from exc
            except (OSError, _Violation) as exc:
                self._close()
                kind = PeerBusy if isinstance(exc, _Refused) else PeerUnavailable
                # the kernel's receive or send timeout (SO_RCVTIMEO, SO_SNDTIMEO) says EAGAIN: "Resource temporarily
                # unavailable" is not what happened
                silent = isinstance(exc, (BlockingIOError, TimeoutError))
                what = f"no answer within {self.timeout:g}s" if silent else exc
                raise kind(f"keeper {self.host}:{self.port}: {what}") from exc
        if "error" in reply[0]:
            raise PeerError(str(reply[0]["error"]))
        return reply

    def _exchange(self, head: bytes, body: memoryview, view: memoryview | None,
                  reply_len: int | None) -> tuple[dict[str, Any], bytes | int]:
        if self._sock is None:
            self._sock = self._connect_admitted()
        self._sock.sendall(head)
        if body.nbytes:
            self._sock.sendall(body)
        reply = _recv_frame(self._sock, self.max_payload, view, reply_len)
        if reply is None:
            raise _ClosedEarly("connection closed by the peer")
        return reply

    def _connect_admitted(self) -> socket.socket:
        """:meth:`_connect`, again after a pause while the server refuses for being at its limit (until
        ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        pause = BUSY_BACKOFF[0]
        while True:
            try:
                return self._connect()
            except _Refused:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(pause, left))
                pause = min(2 * pause, BUSY_BACKOFF[1])

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = bytearray(HELLO.size)
            got = _recv_exact(sock, memoryview(hello))
            if got == 0:
                raise _Refused("refused: the keeper is at its connection limit")
            if got < HELLO.size:
                raise _Violation("connection closed during the handshake")
            magic, version, nonce_s = HELLO.unpack(hello)
            if magic != HANDSHAKE_MAGIC:
                raise _Violation("not an ftrun keeper (bad handshake magic)")
            if version != VERSION:
                raise _Violation(f"peer speaks protocol version {version}, this keeper {VERSION}")
            nonce_c = secrets.token_bytes(NONCE_LEN)
            sock.sendall(nonce_c + _mac(self.secret, b"client", nonce_s, nonce_c))
            proof = bytearray(MAC_LEN)  # a server that rejects the client closes instead of answering
            got = _recv_exact(sock, memoryview(proof))
            if got < MAC_LEN or not hmac.compare_digest(proof, _mac(self.secret, b"server", nonce_c, nonce_s)):
                raise _Violation("authentication failed (the job secrets differ)")
            # blocking from now on, so payloads arrive whole (_recv_exact); the kernel bounds each operation
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))
        except BaseException:
            sock.close()
            raise
        return sock


class PeerPool:
    """Connections to peers' servers for many threads: a request takes an idle connection to its peer (or opens
    one) and gives it back once answered, so a keeper holds about as many connections to a peer as it has
    requests in flight to it, never one per thread that ever asked (a peer refuses connections beyond its
    ``max_connections``). At most ``idle`` idle connections per peer are kept; a failed one is closed."""

    def __init__(self, secret: bytes, timeout: float = 30.0, idle: int = IDLE_CONNECTIONS) -> None:
        _check_secret(secret)
        self.secret, self.timeout, self.idle = secret, timeout, idle
        self._idle: dict[str, list[PeerClient]] = {}  # "host:port" -> connections not in use
        self._lock = threading.Lock()
        self._closed = False

    def request(self, address: str, op: str, into: memoryview | None = None, payload: Buffer | None = None,
                reply_len: int | None = None, **fields: Any) -> tuple[dict[str, Any], bytes | int]:
        """:meth:`PeerClient.request` to the peer at ``address`` ("host:port")."""
        with self._lock:
            idle = self._idle.get(address)
            client = idle.pop() if idle else None
        if client is None:
            host, _, port = address.rpartition(":")
            client = PeerClient(host, int(port), self.secret, self.timeout)
        try:
            return client.request(op, into=into, payload=payload, reply_len=reply_len, **fields)
        finally:
            with self._lock:
                idle = self._idle.setdefault(address, [])
                kept = not self._closed and client.connected and len(idle) < self.idle
                if kept:
                    idle.append(client)
            if not kept:
                client.close()

    def close(self) -> None:
        """Closes the idle connections; a connection in use is closed when its request ends."""
        with self._lock:
            self._closed = True
            clients = [c for idle in self._idle.values() for c in idle]
            self._idle = {}
        for client in clients:
            client.close()
