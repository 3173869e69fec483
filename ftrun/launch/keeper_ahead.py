"""A node's keeper started before the node needs it, so that a lost node's replacement does not wait for it.

A keeper is a new interpreter that imports numpy, pyeclib and ftrun's snapshot modules before it serves: 0.2-0.4 s
here, half of what a hot spare takes from claiming a lost node's rank to training again. So every supervisor,
a spare's and a replacement's too, starts its keeper process as it starts itself, with a socket pair to it, and
hands it the node when the node is known (:meth:`KeeperAhead.start`): the peer socket, then the keeper's
environment as one JSON line (:func:`~ftrun.snapshot.protocol.send_handoff`,
:func:`ftrun.snapshot.keeper.await_start`). From there the keeper runs
as one started the usual way, and prints ``ready`` when it serves.

Invariant: a keeper started ahead touches nothing of any node (no socket, no segment) before its start; one
never started exits when its socket closes (:meth:`KeeperAhead.close`), or dies with its supervisor.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from ftrun.launch.processes import die_with_parent
from ftrun.snapshot.keeper import ENV_KEEPER_HANDOFF, ENV_PEER_FD
from ftrun.snapshot.protocol import send_handoff

KEEPER_COMMAND = [sys.executable, "-P", "-m", "ftrun.snapshot.keeper"]


class KeeperAhead:
    """A keeper process waiting for its node; a child of the calling process, which it dies with."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env[ENV_KEEPER_HANDOFF] = str(theirs.fileno())
        parent = os.getpid()
        self.proc = subprocess.Popen(KEEPER_COMMAND, env=env, stdout=subprocess.PIPE, start_new_session=True,
                                     pass_fds=[theirs.fileno()], preexec_fn=lambda: die_with_parent(parent))
        self.proc.returncode = 0  # reaped by the supervisor's reap(), never by Popen
        theirs.close()
        self._sock: socket.socket | None = ours

    def start(self, env: dict[str, str], peer: socket.socket | None) -> subprocess.Popen[bytes] | None:
        """Hand the keeper its node: ``env`` (``ENV_PEER_FD`` is set by the keeper for ``peer``); the process,
        or None when it is gone (start one the usual way then). Once only."""
        sock, self._sock = self._sock, None
        if sock is None:
            return None
        env = {name: value for name, value in env.items() if name != ENV_PEER_FD}
        line = (json.dumps(env) + "\n").encode()
        return self.proc if send_handoff(sock, line, [peer.fileno()] if peer is not None else []) else None

    def close(self) -> None:
        """Let an unused keeper exit (it reads the end of its socket)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
