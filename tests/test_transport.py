"""Keeper-to-keeper transport: round trips, zero-copy payloads, authentication, and a server that survives abuse.

Raw-socket tests speak the wire protocol from its spec (formats written out here, not taken from the module),
so they also check that the implementation matches the documented protocol.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ftrun.snapshot.transport import (
    MAX_JSON,
    FileRange,
    PeerBusy,
    PeerClient,
    PeerPool,
    PeerError,
    PeerServer,
    PeerUnavailable,
    PeerWrongLength,
    Reply,
)

pytestmark = pytest.mark.timeout(30)

SECRET = b"job-secret-0123456789abcdef"
HELLO = struct.Struct("!4sB32s")
FRAME = struct.Struct("!4sIQ")
CLOSE_WITHIN = 5.0


def handler(request: dict[str, Any]) -> Reply:
    """``echo``: the request back, payload ``text``; ``pieces``: the payload described by ``pieces``; ``fail``."""
    if request["op"] == "echo":
        return Reply({"request": request}, request.get("text", "").encode())
    if request["op"] == "pieces":
        return Reply({}, [FileRange(*p) if isinstance(p, list) else p.encode() for p in request["pieces"]])
    if request["op"] == "fail":
        raise KeyError("no such step")
    raise ValueError(f"unknown op {request['op']}")


class Events:
    """Collects a server's on_event lines (called from server threads)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def wait_for(self, *words: str) -> str:
        deadline = time.monotonic() + CLOSE_WITHIN
        while time.monotonic() < deadline:
            for line in self.lines:
                if all(word in line for word in words):
                    return line
            time.sleep(0.01)
        raise AssertionError(f"no event with {words}: {self.lines}")


@pytest.fixture
def make_server() -> Iterator[Callable[..., tuple[PeerServer, Events]]]:
    servers: list[PeerServer] = []

    def make(**kwargs: Any) -> tuple[PeerServer, Events]:
        events = Events()
        server = PeerServer(SECRET, kwargs.pop("handler", handler), on_event=events, **kwargs)
        servers.append(server)
        server.start()
        return server, events

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def make_client() -> Iterator[Callable[..., PeerClient]]:
    clients: list[PeerClient] = []

    def make(server: PeerServer, secret: bytes = SECRET, **kwargs: Any) -> PeerClient:
        client = PeerClient(*server.address, secret, timeout=kwargs.pop("timeout", 10.0), **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom(1 << 20)
    path = tmp_path / "segment"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return str(path), data


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        assert chunk, "connection closed early"
        buf += chunk
    return bytes(buf)


def raw_connection(server: PeerServer, authenticate: bool = True) -> socket.socket:
    """A plain socket to the server, through the handshake (computed here) when ``authenticate``."""
    sock = socket.create_connection(server.address, timeout=CLOSE_WITHIN)
    if authenticate:
        magic, version, nonce_s = HELLO.unpack(recv_exactly(sock, HELLO.size))
        assert (magic, version) == (b"FTRK", 1)
        nonce_c = os.urandom(32)
        sock.sendall(nonce_c + hmac.new(SECRET, b"client" + nonce_s + nonce_c, hashlib.sha256).digest())
        assert recv_exactly(sock, 32) == hmac.new(SECRET, b"server" + nonce_c + nonce_s, hashlib.sha256).digest()
    return sock


def held_connections(server: PeerServer, count: int) -> list[socket.socket]:
    """``count`` authenticated connections, once the server counts them as serving (it sends its proof, then
    moves the connection from its handshakes to those it serves: a loaded host lags between the two)."""
    socks = [raw_connection(server) for _ in range(count)]
    deadline = time.monotonic() + CLOSE_WITHIN
    while len(server._serving) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return socks


def assert_closed_by_server(sock: socket.socket) -> None:
    """The server closes the connection within CLOSE_WITHIN seconds (whatever it sent before is skipped)."""
    sock.settimeout(CLOSE_WITHIN)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:  # the server closed with our bytes still unread
        pass
    finally:
        sock.close()


def assert_serves(make_client: Callable[..., PeerClient], server: PeerServer) -> None:
    _, payload = make_client(server).request("echo", text="still here")
    assert payload == b"still here"


def test_round_trip_fields_and_payload(make_server, make_client) -> None:
    server, events = make_server()
    client = make_client(server)
    fields, payload = client.request("echo", step=7, ranks=[0, 1], meta={"k": "v"}, text="hello")
    assert fields == {"request": {"op": "echo", "step": 7, "ranks": [0, 1], "meta": {"k": "v"}, "text": "hello"}}
    assert payload == b"hello"
    assert client.request("echo") == ({"request": {"op": "echo"}}, b"")
    assert events.lines == []


def test_file_ranges_and_bytes_received_as_bytes_and_into(make_server, make_client, data_file) -> None:
    path, data = data_file
    server, _ = make_server()
    client = make_client(server)
    pieces = [[path, 10, 1000], "-mid-", [path, 0, 0], [path, len(data) - 5, 5], [path, 4096, 300_000]]
    expected = data[10:1010] + b"-mid-" + data[-5:] + data[4096:304_096]
    assert client.request("pieces", pieces=pieces)[1] == expected
    buffer = bytearray(len(expected) + 100)
    assert client.request("pieces", into=memoryview(buffer), pieces=pieces) == ({}, len(expected))
    assert buffer[: len(expected)] == expected
    assert client.request("pieces", into=memoryview(buffer), pieces=[]) == ({}, 0)


def test_large_payload_arrives_intact(make_server, make_client, tmp_path) -> None:
    data = os.urandom(40 << 20)
    path = tmp_path / "big"
    path.write_bytes(data)
    path.chmod(0o600)
    server, _ = make_server()
    client = make_client(server)
    pieces = [[str(path), 0, len(data)], "trailer"]
    expected = hashlib.sha256(data + b"trailer").hexdigest()
    assert hashlib.sha256(client.request("pieces", pieces=pieces)[1]).hexdigest() == expected
    buffer = bytearray(len(data) + 7)
    assert client.request("pieces", into=memoryview(buffer), pieces=pieces)[1] == len(buffer)
    assert hashlib.sha256(buffer).hexdigest() == expected


def test_a_peer_that_stops_sending_is_unavailable_within_the_timeout(make_server, make_client) -> None:
    """Payloads are received in whole-payload system calls (MSG_WAITALL on a blocking socket): the kernel's
    receive timeout still bounds them, whether the handler never answers or the peer stops mid-payload."""
    release = threading.Event()

    def hanging(request: dict[str, Any]) -> Reply:
        release.wait(CLOSE_WITHIN)
        return Reply({}, b"late")

    server, _ = make_server(handler=hanging)
    listener = socket.create_server(("127.0.0.1", 0))

    def stalling() -> None:  # a keeper that authenticates, announces 2 MiB, sends 1 MiB and stops
        conn, _ = listener.accept()
        with conn:
            nonce_s = os.urandom(32)
            conn.sendall(HELLO.pack(b"FTRK", 1, nonce_s))
            nonce_c = recv_exactly(conn, 64)[:32]
            conn.sendall(hmac.new(SECRET, b"server" + nonce_c + nonce_s, hashlib.sha256).digest())
            recv_exactly(conn, FRAME.size)
            conn.sendall(frame(b"{}", 2 << 20) + bytes(1 << 20))
            release.wait(CLOSE_WITHIN)

    thread = threading.Thread(target=stalling, daemon=True)
    thread.start()
    try:
        for client in (make_client(server, timeout=0.5), PeerClient(*listener.getsockname()[:2], SECRET, timeout=0.5)):
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable, match=r"keeper 127\.0\.0\.1:\d+: no answer within 0\.5s$"):
                client.request("get", into=memoryview(bytearray(2 << 20)))  # was "[Errno 11] Resource temporarily..."
            assert time.monotonic() - t0 < CLOSE_WITHIN / 2
            client.close()
    finally:
        release.set()
        thread.join(CLOSE_WITHIN)
        listener.close()


@pytest.mark.parametrize("source", ["memory", "file"])
def test_a_peer_that_stops_reading_a_reply_is_dropped_within_the_timeout(make_server, make_client, tmp_path,
                                                                         source) -> None:
    """A peer that asks for more than the sockets buffer and reads none of it (its keeper stopped, or its host
    gone while its connection stays open) is dropped after the server's timeout, as one that stops sending: it
    does not hold its thread and its place among ``max_connections`` for good (at the limit, every other peer was
    refused)."""
    size = 32 << 20  # more than a loopback connection's socket buffers hold
    path = tmp_path / "sparse"
    with open(path, "wb") as file:
        file.truncate(size)
    server, events = make_server(handler=lambda request: Reply({}, [FileRange(str(path), 0, size)] if source == "file"
                                                              else bytes(size)), max_connections=1, timeout=0.5)
    stalled = raw_connection(server)
    try:
        stalled.sendall(frame(b'{"op":"big"}'))
        events.wait_for("127.0.0.1:", "took none of its reply for 0.5s", "connection closed")
        assert make_client(server, timeout=CLOSE_WITHIN).request("big", into=bytearray(size))[1] == size
    finally:
        stalled.close()


def test_handler_error_is_an_error_reply_and_the_connection_stays(make_server, make_client, tmp_path) -> None:
    server, events = make_server()
    client = make_client(server)
    client.request("echo")
    connection = client._sock
    with pytest.raises(PeerError, match=r"KeyError: 'no such step'"):
        client.request("fail")
    with pytest.raises(PeerError, match="FileNotFoundError"):  # a Reply whose file is missing, before any byte
        client.request("pieces", pieces=["x", [str(tmp_path / "missing"), 0, 1]])
    with pytest.raises(PeerError, match="past the end"):
        client.request("pieces", pieces=[[__file__, 0, 1 << 30]])
    assert client.request("echo", text="ok")[1] == b"ok"
    assert client._sock is connection
    assert events.lines == []


def test_a_bug_in_a_connection_thread_closes_that_connection_in_one_line(make_server, make_client,
                                                                       monkeypatch) -> None:
    """An error the server does not expect in a connection's thread (here the sink's ``done``; a reply the socket
    cannot send, ...) ended the thread with a traceback on stderr and nothing in the events. Now it closes that
    connection with one line naming the peer and the error, and the server answers the next one."""
    uncaught: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)

    def sink(request: dict[str, Any], length: int) -> tuple[memoryview, Callable[[bool], None]]:
        def done(received: bool) -> None:
            raise RuntimeError("a bug in done")

        return memoryview(bytearray(length)), done

    server, events = make_server(max_payload=1 << 10, sink=sink)
    with pytest.raises(PeerUnavailable):
        make_client(server).request("echo", payload=b"x" * 100)
    line = events.wait_for("internal error")
    assert line.startswith("peer 127.0.0.1:") and line.endswith(
        ": internal error (RuntimeError: a bug in done); connection closed"), line
    assert_serves(make_client, server)
    assert uncaught == []


def test_a_connection_that_gets_no_thread_is_closed_and_the_server_accepts_the_next(make_server, make_client,
                                                                                   monkeypatch) -> None:
    """A connection whose thread could not start (the process at its thread limit) ended the accept loop: the
    server took no connection for the rest of the job, and its peers' requests timed out. Now that connection is
    closed (its client connects again, as to a server at its limit) and reported in one line."""
    start = threading.Thread.start
    refused: list[str] = []

    def start_unless_first_connection(thread: threading.Thread) -> None:
        if thread.name.startswith("ftrun-peer-127.") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    server, events = make_server()
    monkeypatch.setattr(threading.Thread, "start", start_unless_first_connection)
    assert make_client(server, timeout=CLOSE_WITHIN).request("echo", text="in")[1] == b"in"
    assert refused and events.wait_for("can't start new thread; connection closed")


def test_serve_raises_what_it_cannot_handle_and_close_waits_for_it(make_server) -> None:
    """:meth:`PeerServer.serve` raises an error it does not expect, for its caller to act on (the keeper exits
    and is restarted), and :meth:`PeerServer.close` returns once it has ended."""

    class Broken(socket.socket):
        def accept(self) -> tuple[socket.socket, Any]:
            raise ValueError("a bug in accept")

    listener = socket.create_server(("127.0.0.1", 0))
    server = PeerServer(SECRET, handler, listener=Broken(fileno=listener.detach()))
    with pytest.raises(ValueError, match="a bug in accept"):
        server.serve()
    server.close()


def test_wrong_secret_is_refused_and_reported(make_server, make_client) -> None:
    server, events = make_server()
    with pytest.raises(PeerUnavailable, match="authentication failed"):
        make_client(server, secret=b"another-secret-0123456789").request("echo")
    events.wait_for("authentication failed", "127.0.0.1:")
    assert_serves(make_client, server)


def test_client_refuses_a_server_without_the_secret(make_client) -> None:
    """A fake server that sends a valid hello but cannot prove the secret: the client must not trust it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(HELLO.pack(b"FTRK", 1, os.urandom(32)))
            recv_exactly(conn, 64)
            conn.sendall(os.urandom(32))
            conn.recv(1)

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    try:
        client = PeerClient(*listener.getsockname()[:2], SECRET, timeout=CLOSE_WITHIN)
        with pytest.raises(PeerUnavailable, match="authentication failed"):
            client.request("echo")
        client.close()
        thread.join(CLOSE_WITHIN)
    finally:
        listener.close()


def frame(fields: bytes, payload_len: int = 0, magic: bytes = b"FTRF", json_len: int | None = None) -> bytes:
    return FRAME.pack(magic, len(fields) if json_len is None else json_len, payload_len) + fields


VIOLATIONS = [
    # (name, authenticate first, bytes sent, words of the reported event)
    ("garbage instead of handshake", False, b"GET / HTTP/1.1\r\nHost: keeper\r\n\r\n" * 4, ["authentication failed"]),
    ("bad frame magic", True, frame(b'{"op":"echo"}', magic=b"HTTP"), ["bad frame magic"]),
    ("json too long", True, frame(b"", json_len=MAX_JSON + 1), ["JSON", "exceeds"]),
    ("payload too long", True, frame(b'{"op":"echo"}', payload_len=(1 << 20) + 1), ["payload", "exceeds"]),
    ("json is a list", True, frame(b'["op","echo"]'), ["not an object"]),
    ("json is not utf-8", True, frame(b'{"op":"\xff"}'), ["does not parse"]),
    ("json does not parse", True, frame(b'{"op":'), ["does not parse"]),
    ("json nested too deep", True, frame(b"[" * 60000), ["does not parse"]),
    ("closed mid-frame", True, frame(b'{"op":"echo"}', payload_len=10)[:-3], ["closed during"]),
]


def test_protocol_violations_close_the_connection_and_are_reported(make_server, make_client) -> None:
    server, events = make_server(max_payload=1 << 20)
    for name, authenticate, data, words in VIOLATIONS:
        sock = raw_connection(server, authenticate)
        sock.sendall(data)
        if name == "closed mid-frame":
            sock.shutdown(socket.SHUT_WR)
        assert_closed_by_server(sock)
        line = events.wait_for(*words)
        assert "127.0.0.1:" in line, name
    assert len(events.lines) == len(VIOLATIONS), events.lines
    assert_serves(make_client, server)


def test_request_without_op_is_an_error_reply(make_server) -> None:
    server, events = make_server()
    sock = raw_connection(server)
    try:
        sock.sendall(frame(b'{"step":3}'))
        _, json_len, payload_len = FRAME.unpack(recv_exactly(sock, FRAME.size))
        assert json.loads(recv_exactly(sock, json_len)) == {"error": "ValueError: the request has no op"}
        assert payload_len == 0
    finally:
        sock.close()


def test_silent_client_does_not_block_others_and_is_dropped(make_server, make_client) -> None:
    server, events = make_server(handshake_timeout=0.5)
    silent = raw_connection(server, authenticate=False)
    started = time.monotonic()
    assert_serves(make_client, server)
    assert_closed_by_server(silent)
    assert 0.4 < time.monotonic() - started < CLOSE_WITHIN
    events.wait_for("handshake not completed within 0.5s", "127.0.0.1:")


def test_connections_beyond_the_limit_are_closed_at_once(make_server, make_client) -> None:
    server, events = make_server(max_connections=2)
    held = held_connections(server, 2)
    try:
        extra = raw_connection(server, authenticate=False)
        assert_closed_by_server(extra)
        events.wait_for("refused", "2 connections already open")
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + CLOSE_WITHIN
    while server._connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_serves(make_client, server)


def test_unauthenticated_connections_cannot_lock_peers_out(make_server, make_client) -> None:
    """Anyone who reaches the port (no secret) holds many silent connections open, opening new ones as fast as the
    server drops them: a peer with the secret is still served at once. Connections still in their handshake are
    bounded on their own; the newest evicts the oldest, so only authenticated ones count against the limit."""
    server, events = make_server(max_connections=4, handshake_timeout=60.0)
    silent = [raw_connection(server, authenticate=False) for _ in range(20)]
    try:
        client = make_client(server, timeout=1.0)
        assert client.request("echo", text="served")[1] == b"served"
        events.wait_for("127.0.0.1:", "evicted")
        assert_closed_by_server(silent[0])  # the oldest went first
        held = [make_client(server, timeout=1.0) for _ in range(3)]  # authenticated ones fill up to the limit
        for other in held:
            assert other.request("echo", text="kept")[1] == b"kept"
        with pytest.raises(PeerBusy):
            make_client(server, timeout=0.3).request("echo", text="one too many")
    finally:
        for sock in silent:
            sock.close()


def test_a_client_refused_at_the_limit_connects_again_until_its_timeout(make_server, make_client) -> None:
    """A keeper at its connection limit is busy, not lost: the request waits for a connection to end (within the
    client's timeout); a server that stays full is :class:`PeerBusy` after about that timeout."""
    server, events = make_server(max_connections=1)
    [held] = held_connections(server, 1)
    threading.Timer(0.3, held.close).start()
    started = time.monotonic()
    first = make_client(server, timeout=CLOSE_WITHIN)
    assert first.request("echo", text="admitted")[1] == b"admitted"
    assert 0.25 < time.monotonic() - started < CLOSE_WITHIN
    events.wait_for("refused", "1 connections already open")
    first.close()
    deadline = time.monotonic() + CLOSE_WITHIN
    while server._connections and time.monotonic() < deadline:
        time.sleep(0.01)
    [held] = held_connections(server, 1)
    try:
        started = time.monotonic()
        with pytest.raises(PeerBusy, match="connection limit"):
            make_client(server, timeout=0.5).request("echo", text="never")
        assert 0.4 < time.monotonic() - started < CLOSE_WITHIN
    finally:
        held.close()


def test_a_kept_connection_the_peer_closed_is_replaced_once(make_server, make_client) -> None:
    """A connection kept from an earlier request that the peer closed or reset meanwhile is not a lost peer: the
    request goes out again on a new connection. A peer that is gone is still unavailable, at once."""
    server, events = make_server()
    client = make_client(server)
    for how in ("close", "reset"):
        assert client.request("echo", text="first")[1] == b"first"
        deadline = time.monotonic() + CLOSE_WITHIN
        while not server._connections and time.monotonic() < deadline:
            time.sleep(0.01)
        (kept,) = server._connections
        if how == "reset":
            kept.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            kept.close()
        else:
            kept.shutdown(socket.SHUT_RDWR)
        time.sleep(0.1)
        assert client.request("echo", text=how)[1] == how.encode()
    assert not [line for line in events.lines if "refused" in line], events.lines
    server.close()
    with pytest.raises(PeerUnavailable) as caught:
        client.request("echo", text="gone")
    assert not isinstance(caught.value, PeerBusy)


def serve_scripted(listener: socket.socket, replies: list[Callable[[socket.socket], None]]) -> None:
    """A server speaking the protocol from its spec: on its i-th connection, the handshake, one request read, then
    ``replies[i](conn)`` (what the client gets back), then the connection closed."""
    for reply in replies:
        conn, _ = listener.accept()
        with conn:
            nonce_s = os.urandom(32)
            conn.sendall(HELLO.pack(b"FTRK", 1, nonce_s))
            answer = recv_exactly(conn, 64)
            conn.sendall(hmac.new(SECRET, b"server" + answer[:32] + nonce_s, hashlib.sha256).digest())
            _, json_len, payload_len = FRAME.unpack(recv_exactly(conn, FRAME.size))
            recv_exactly(conn, json_len + payload_len)
            reply(conn)


@pytest.mark.parametrize("how", ["closed", "reset"])
def test_a_reply_cut_short_by_the_peer_is_asked_for_again_at_once(how) -> None:
    """A connection the peer closes or resets in the middle of its reply (a keeper restarting its peer server, a
    reset on the way) is not a lost peer, even on a connection opened for that request: the request goes out again
    at once on a new one, and the answer is whole."""
    data = os.urandom(1 << 16)
    reply = FRAME.pack(b"FTRF", 2, len(data)) + b"{}"

    def cut(conn: socket.socket) -> None:
        conn.sendall(reply + data[:1000])
        if how == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=serve_scripted, args=(listener, [cut, lambda conn: conn.sendall(reply + data)]),
                              daemon=True)
    thread.start()
    try:
        client = PeerClient(*listener.getsockname()[:2], SECRET, timeout=30)
        into = memoryview(bytearray(len(data)))
        began = time.monotonic()
        assert client.request("chunk", into=into)[1] == len(data) and bytes(into) == data
        assert time.monotonic() - began < client.timeout / 2  # at once, not after the timeout
        client.close()
        thread.join(CLOSE_WITHIN)
        assert not thread.is_alive()  # both connections served
    finally:
        listener.close()


def test_a_reply_of_another_length_than_asked_is_refused_before_it_is_received() -> None:
    """A reply that announces a payload of another length than the request asks for (here 512 MiB, sent never) is
    refused from its header, nothing allocated for it: a wrong answer (PeerError), not a lost peer. An error reply
    is still one."""

    def announce(conn: socket.socket) -> None:
        conn.sendall(FRAME.pack(b"FTRF", 2, 512 << 20) + b"{}")
        conn.recv(1)  # open until the client closes it: a client that waited for the payload would wait in vain

    def error(conn: socket.socket) -> None:
        body = json.dumps({"error": "KeyError: no such step"}).encode()
        conn.sendall(FRAME.pack(b"FTRF", len(body), 0) + body)

    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=serve_scripted, args=(listener, [announce, announce, error]), daemon=True)
    thread.start()
    try:
        client = PeerClient(*listener.getsockname()[:2], SECRET, timeout=CLOSE_WITHIN)
        with pytest.raises(PeerWrongLength, match="a reply of 536870912 bytes to a request for 4096"):
            client.request("chunk", into=memoryview(bytearray(4096)), reply_len=4096)
        with pytest.raises(PeerWrongLength, match="to a request for 0"):
            client.request("info", reply_len=0)
        with pytest.raises(PeerError, match="no such step") as caught:
            client.request("chunk", reply_len=4096)
        assert not isinstance(caught.value, PeerWrongLength)
        client.close()
        thread.join(CLOSE_WITHIN)
    finally:
        listener.close()


def test_payload_larger_than_into_or_max_payload_is_unavailable(make_server, make_client) -> None:
    server, _ = make_server()
    client = make_client(server)
    with pytest.raises(PeerUnavailable, match="exceeds the 4-byte buffer"):
        client.request("echo", into=memoryview(bytearray(4)), text="too long")
    assert client.request("echo", text="reconnects")[1] == b"reconnects"
    with pytest.raises(PeerUnavailable, match="exceeds 8"):
        make_client(server, max_payload=8).request("echo", text="nine bytes")
    with pytest.raises(ValueError, match="writable"):
        client.request("echo", into=memoryview(b"read-only"))


def test_server_close_drops_connections_and_is_idempotent(make_server, make_client) -> None:
    server, events = make_server()
    client = make_client(server)
    client.request("echo")
    server.close()
    server.close()
    with pytest.raises(PeerUnavailable):
        client.request("echo")
    with pytest.raises(PeerUnavailable):
        client.request("echo")
    assert events.lines == []


def test_short_secret_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PeerServer(b"short", handler)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PeerClient("127.0.0.1", 1, b"short")


def test_module_does_not_import_torch() -> None:
    code = "import sys, ftrun.snapshot.transport; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=20).returncode == 0


class Sink:
    """A server's sink into one buffer: payloads of ``put`` land at their ``offset``; ``done`` calls recorded."""

    def __init__(self, size: int) -> None:
        self.memory = bytearray(size)
        self.done: list[tuple[int, bool]] = []
        self.called = threading.Event()

    def __call__(self, request: dict[str, Any], length: int) -> tuple[memoryview, Callable[[bool], None]]:
        if request["op"] != "put":
            raise LookupError(f"no place for {request['op']}")
        offset = int(request["offset"])

        def done(received: bool) -> None:
            self.done.append((offset, received))
            self.called.set()

        return memoryview(self.memory)[offset:offset + length], done


def test_a_request_payload_is_received_where_the_sink_says(make_server, make_client) -> None:
    sink = Sink(1 << 20)
    server, _ = make_server(max_payload=1 << 20, sink=sink,
                            handler=lambda r: Reply({"got": r.get("offset")}, r.get("text", "").encode()))
    client = make_client(server)
    data = os.urandom(300_000)
    assert client.request("put", payload=data, offset=4096)[0] == {"got": 4096}
    assert bytes(sink.memory[4096:4096 + len(data)]) == data and sink.done == [(4096, True)]
    # a sink that has no place: an error reply, the payload dropped, the connection still in step
    with pytest.raises(PeerError, match="LookupError: no place for echo"):
        client.request("echo", payload=b"x" * 5000, text="hi")
    assert client.request("echo", text="still here")[1] == b"still here"
    # a payload cut off by the client's end: ``done(False)``, and the connection is closed
    sock = raw_connection(server, True)
    body = json.dumps({"op": "put", "offset": 0}).encode()
    sock.sendall(FRAME.pack(b"FTRF", len(body), 1000) + body + b"y" * 10)
    sink.called.clear()
    sock.shutdown(socket.SHUT_WR)
    assert sink.called.wait(CLOSE_WITHIN) and sink.done[-1] == (0, False)
    assert_closed_by_server(sock)


def test_a_pool_holds_connections_for_the_requests_in_flight_and_a_few_idle(make_server):
    """Threads that come and go (a keeper's server threads relaying a rebuild) share a pool's connections: a peer
    that admits 6 never refuses one, and once the requests end at most ``idle`` stay open."""
    server, events = make_server(max_connections=6)
    pool = PeerPool(SECRET, timeout=10.0, idle=2)
    address = f"{server.address[0]}:{server.address[1]}"
    answers: list[bytes | int] = []
    try:
        for _ in range(20):
            threads = [threading.Thread(target=lambda n=n: answers.append(
                pool.request(address, "echo", text=str(n))[1])) for n in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert sorted(answers) == sorted(str(n).encode() for n in range(6) for _ in range(20))  # type: ignore
        assert not [line for line in events.lines if "refused" in line], events.lines
        with pytest.raises(PeerError, match="no such step"):
            pool.request(address, "fail")  # an error reply keeps the connection
        deadline = time.monotonic() + CLOSE_WITHIN
        while len(server._connections) > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(server._connections) <= 2
    finally:
        pool.close()
    deadline = time.monotonic() + CLOSE_WITHIN
    while server._connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server._connections


@pytest.mark.parametrize("sent", [
    frame(b'{"op":"echo"}')[:8],  # half a header
    frame(b'{"op":"echo","text":"' + b"x" * 100 + b'"}')[:40],  # a header and part of its JSON
    frame(b'{"op":"echo"}', 2 << 20) + bytes(1 << 20),  # half a payload that has no place (it is read and dropped)
], ids=["header", "json", "dropped payload"])
def test_a_peer_that_stops_midway_through_a_request_is_dropped_within_the_timeout(make_server, make_client,
                                                                                  sent) -> None:
    """A peer with the secret that sends part of a request and stalls (a slow-loris, or a keeper stopped mid-push)
    is dropped after the server's timeout, as a stalled sink payload is: it cannot hold the place of a peer among
    ``max_connections`` for good. A connection idle between requests stays open however long it idles."""
    server, events = make_server(max_payload=4 << 20, sink=Sink(0), max_connections=2, timeout=0.5)
    idle = make_client(server)
    assert idle.request("echo", text="before")[1] == b"before"
    stalled = raw_connection(server)
    try:
        stalled.sendall(sent)
        events.wait_for("127.0.0.1:", "request stalled for 0.5s", "connection closed")
        assert make_client(server).request("echo", text="a new peer")[1] == b"a new peer"
        time.sleep(1.5)
        assert idle.request("echo", text="after")[1] == b"after"  # idle for 3 timeouts and more: still open
    finally:
        stalled.close()
