"""Job events: one line each, human-readable on stderr and JSON lines in ``<log-dir>/events.jsonl``.

Every process of a job (launcher, supervisors) appends to the same file; each event is one ``write`` on an
``O_APPEND`` descriptor, so lines from different processes never interleave. Fields common to all events:
``time`` (wall clock, seconds), ``event`` (a name from the list below), ``source`` ("launcher", "node N",
"keeper N" or "spare NAME"), ``message`` (the terminal text). Event names: start, node_start, keeper_start,
trainers_started, failure (with the failed rank's last ``step``), generation, restore (per node: the agreed ``step``,
``restored_from``: "ram", "disk", "parity" (with ``rebuilt``: node -> the nodes it rebuilds from) or "none", and
``verified``: bytes of the node's slots of that step whose checksums its keeper verified, in ``verify_seconds``),
restored (per rank: bytes, seconds), stopped, stop (a supervisor was told to stop, by ``signal``: every node
stops, persists and exits), all_running, first_heartbeat, recovered, keeper_failed,
keeper_thread_failed (a keeper's background ``thread`` failed; the keeper exits to be restarted), store_kept (a
launcher hosting the control store keeps it up after a spare took its node's rank, until the job ends),
keeper_adopted, slot_allocated, slot_invalid, inject, zygote, node_lost, node_done, failed, parity (a keeper
computed its parity of a step), parity_failed, protected (a group's protected step advanced), rebuilt,
rebuild_failed, peer_rejected (a keeper's peer server refused a connection, or one ended by a fault: a reset, a
broken frame; ``message`` names the peer and says which), store_rejected (a control-store value that is not
authentic, or a replayed older generation, was ignored; once per key and process), persisted (a step complete on
disk), durability (degraded), loaded (a keeper loaded a step from disk), restore_source_failed (a parity rebuild
or disk load of the planned step failed; the next source is planned), no_resume, spare_up (a hot spare is ready),
spare_claimed (a spare took a lost node's ``node`` rank, ``seconds`` after the failure was seen), spare_took (the
local launcher hands that node to it), spare_gone, replaced (a supervisor seen as lost found its rank taken by a
spare and left), store_outage (the control store stopped answering, or answers again), signal_ignored (the
launcher got SIGUSR1 or SIGUSR2, SLURM's warning, without --signals-to-handle listing it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

EVENTS_FILE = "events.jsonl"
BRIEF_RUNS = 8  # runs of consecutive numbers a message lists (a hang of one rank of 16,384 silences all the others)


def brief_numbers(numbers: Iterable[int]) -> str:
    """Node or rank numbers for a message, bounded however many: runs of consecutive ones as ranges, at most
    :data:`BRIEF_RUNS` of them, and how many in all when some are left out: ``[1, 3-9]``, ``[0-2, 4, 6, 8, 10, 12,
    14, 16, ... (5000 in all)]``. An event's fields carry the whole list."""
    ordered = sorted(set(numbers))
    runs: list[list[int]] = []
    for number in ordered:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:BRIEF_RUNS]]
    if len(runs) > BRIEF_RUNS:
        shown.append(f"... ({len(ordered)} in all)")
    return f"[{', '.join(shown)}]"


class EventLog:
    """Writes events of one process; safe to share the file with other processes of the job."""

    def __init__(self, source: str, log_dir: str | None, stream: TextIO | None = sys.stderr) -> None:
        self.source = source
        self._stream = stream
        self._fd: int | None = None
        if log_dir is not None:
            os.makedirs(log_dir, mode=0o700, exist_ok=True)
            self._fd = os.open(os.path.join(log_dir, EVENTS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def emit(self, event: str, message: str, *, console: bool = True, **fields: Any) -> None:
        now = time.time()
        if console and self._stream is not None:
            clock = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
            self._stream.write(f"ftrun {clock} [{self.source}] {message}\n")
            self._stream.flush()
        if self._fd is not None:
            record = {"time": now, "event": event, "source": self.source, "message": message, **fields}
            os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(log_dir: str) -> list[dict[str, Any]]:
    """All events of a log directory, in file order."""
    path = os.path.join(log_dir, EVENTS_FILE)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
