"""The supervisor's watch on its keeper's answers.

A keeper that died is seen by ``waitpid`` and restarted at once
(:meth:`~ftrun.launch.keeper_process.KeeperProcess.exited`). One that lives but answers nothing (stopped with
SIGSTOP, deadlocked) was seen by nothing: its trainers wait for it in their next snapshot, still beating, and the
job hung silently. So a thread of the supervisor asks the keeper
``ping`` (answered at once, under no lock) every :data:`PING_INTERVAL` seconds; once no answer came for
``silence`` seconds it kills the keeper, which the supervisor then restarts as one that died: the snapshots stay
in /dev/shm for the new keeper to re-adopt, and the trainers reconnect.

Invariant: only silence this process saw counts. If the thread itself was held up (the supervisor stopped or
starved), the time it was away is not the keeper's silence.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from ftrun.snapshot.protocol import KeeperClient

PING_INTERVAL = 1.0  # seconds between two pings
PING_TIMEOUT = 2.0  # seconds one ping waits for its answer (twice: on the open connection, then a new one)
MIN_SILENCE = 15.0  # the least silence that kills a keeper (the supervisor passes 3 x --node-timeout if more)


class KeeperWatch:
    """Pings keeper ``pid`` at socket ``name`` from a daemon thread; after ``silence`` seconds without an answer,
    tells ``say`` and kills it (SIGKILL). :meth:`stop` before the supervisor reaps or stops that keeper."""

    def __init__(self, name: str, pid: int, silence: float, say: Callable[[str], None]) -> None:
        self.name, self.pid, self.silence, self.say = name, pid, max(MIN_SILENCE, silence), say
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ftrun-keeper-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        client = KeeperClient(self.name, patience=0.0, timeout=PING_TIMEOUT)
        answered = last_look = time.monotonic()
        try:
            while not self._stopped.wait(PING_INTERVAL):
                reply = client.try_request("ping")
                now = time.monotonic()
                if reply is not None or now - last_look > PING_INTERVAL + 2 * PING_TIMEOUT + 1.0:
                    answered = now  # an answer; or this thread was away itself: the keeper gets a new chance
                last_look = now
                if now - answered >= self.silence and not self._stopped.is_set():
                    self.say(f"keeper (pid {self.pid}) answered nothing for {now - answered:.0f} s (stopped or "
                             "stuck): killing it, to restart it")
                    os.kill(self.pid, signal.SIGKILL)
                    return
        finally:
            client.close()
