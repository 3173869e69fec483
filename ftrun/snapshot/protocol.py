"""The keeper's local socket: JSON lines over an abstract Unix socket, one request and one reply at a time.

The socket is ``\\0ftrun-keeper-<job>-node<N>`` (abstract: no file to leave behind); the keeper accepts only
peers of its own user (``SO_PEERCRED``), and a client talks only to a keeper of its own user (any user may bind an
abstract name, a keeper's while it restarts say, and answer in its place). Each message is one JSON object on one
line; requests carry ``op``, replies carry ``error`` when the request failed. Nothing is unpickled. Requests, by
sender:

trainer     ``restore {rank, generation}`` -> ``{step, slot, path}`` (step 0 and no slot: start from scratch);
            waits until the supervisor has told the keeper the generation's agreed step.
            ``reserve {rank, step, generation, size, skip}`` -> ``{slot, path}``: the slot to copy into, of at
            least ``size`` payload bytes, once overwriting it keeps the newest globally restorable step; or
            ``{skip}`` (why), with ``skip`` true, when that would mean waiting while the rank's newest snapshot
            is at most ``STALE_INTERVALS`` of its intervals old: the trainer skips this snapshot.
            ``commit {rank, slot, step}`` -> ``{}`` after the trainer marked the slot committed.
            ``corrupt {rank, slot, reason}`` -> ``{}``: the trainer found the slot invalid at restore.
            ``restored {rank, step, nbytes, seconds}`` -> ``{}``: for the events log.
supervisor  ``held {generation}`` -> ``{held: {rank: [steps]}}``: verified steps of every local rank.
            ``poll {generation, plan, restorable, abandoned, ..., wait, seen}`` -> ``{local, some, decided, fatal,
            ..., version}``: tells the agreed restore step of the generation (the first time: slots of newer
            steps from older generations are discarded), the newest step every rank of the job holds and the
            steps the job abandoned; answers the steps every local rank holds, those some local rank holds, the
            newest step every local rank took or skipped, and a fatal error if any. With ``wait`` > 0 the answer
            comes once its ``version`` differs from ``seen`` (the caller's last), or after ``wait`` seconds (at
            most ``POLL_WAIT``): an idle node's link sleeps in the keeper instead of asking 100 times a second.
            ``nudge`` -> ``{}``: a waiting ``poll`` answers now. ``ping`` -> ``{}`` at once, taking no lock: the
            supervisor's check that the keeper still serves (:mod:`ftrun.launch.keeper_watch`).
            ``peers {peers}`` -> ``{}``: the group's keepers' addresses, before a rebuild (survivors relay it).

Hand-off (:func:`send_handoff`, :func:`receive_handoff`): how a process started ahead, a keeper or a zygote's
ready trainer, is told what to run once it is needed, on a socket pair of its own: descriptors (SCM_RIGHTS, on
one marker byte), then one line.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

MAX_LINE = 1 << 20
ENV_KEEPER_SOCKET = "FTRUN_KEEPER_SOCKET"
POLL_WAIT = 1.0  # seconds: the longest a ``poll`` waits for a change
PEER_LOST = "peer lost"  # starts the error of a rebuild that failed because a survivor became unreachable


_HANDOFF_MARK = b"H"  # the byte that carries a hand-off's descriptors


def send_handoff(sock: socket.socket, line: bytes, fds: Sequence[int] = ()) -> bool:
    """Hand the process waiting in :func:`receive_handoff` at the other end of ``sock`` ``fds`` then ``line``
    (ending in a newline), and close ``sock``; False when that process is gone."""
    try:
        socket.send_fds(sock, [_HANDOFF_MARK], list(fds))
        sock.sendall(line)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def receive_handoff(sock: socket.socket, max_fds: int) -> tuple[bytes, list[int]]:
    """Wait on ``sock`` for what :func:`send_handoff` sends, and close it: (line, descriptors), or (b"", [])
    when the other end closed it without a hand-off."""
    mark, fds, _, _ = socket.recv_fds(sock, 1, max_fds)
    line = sock.makefile("rb").readline() if mark == _HANDOFF_MARK else b""
    sock.close()
    return line, fds


class KeeperUnavailable(ConnectionError):
    """The keeper did not answer within the deadline (it may be restarting)."""


class KeeperError(RuntimeError):
    """The keeper answered with an error."""


def socket_name(job: str, node: int) -> str:
    return f"ftrun-keeper-{job}-node{node}"


def _address(name: str) -> str:
    return "\0" + name


def listen(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(_address(name))
    sock.listen(64)
    return sock


def same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


class LineSocket:
    """A connected socket read and written as JSON lines."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed the connection."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE:
                raise ValueError("message too long")
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("message is not a JSON object")
        return message

    def close(self) -> None:
        self.sock.close()

    def __del__(self) -> None:  # dropped unclosed (a trainer's, as its script returns): closed without a warning
        self.sock.close()


class KeeperClient:
    """A trainer's or supervisor's connection to its node's keeper; reconnects across keeper restarts.

    A request whose connection breaks is sent again on a new connection (every request is idempotent), for
    up to ``patience`` seconds; then :class:`KeeperUnavailable`. With ``timeout``, a reply that takes longer
    counts as a broken connection (for requests the keeper answers at once: a stopped keeper accepts
    connections and never answers).
    """

    def __init__(self, name: str, patience: float = 60.0, timeout: float | None = None) -> None:
        self.name = name
        self.patience = patience
        self.timeout = timeout
        self._conn: LineSocket | None = None

    def _connect(self) -> LineSocket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(_address(self.name))
            if not same_user(sock):
                raise PermissionError(f"{self.name} is held by a process of another user, not a keeper")
        except OSError:
            sock.close()
            raise
        return LineSocket(sock)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.patience
        while (reply := self._exchange(op, fields)) is None:
            if time.monotonic() > deadline:
                raise KeeperUnavailable(f"keeper {self.name} not answering for {self.patience:g}s")
            time.sleep(0.05)
        if "error" in reply:
            raise KeeperError(reply["error"])
        return reply

    def try_request(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """``op`` without waiting for a keeper that does not answer: on the open connection, then once on a new one
        (a keeper restarted since closed the old one); its reply, or None."""
        reply = self._exchange(op, fields)
        return reply if reply is not None else self._exchange(op, fields)

    def _exchange(self, op: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """One request and its reply; None (and the connection closed) when the connection fails."""
        try:
            if self._conn is None:
                self._conn = self._connect()
            self._conn.send({"op": op, **fields})
            reply = self._conn.receive()
            if reply is not None:
                return reply
        except (OSError, ValueError):
            pass
        self.close()
        return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
