"""What a supervisor says of a failed trainer, and what it leaves for the scheduler when the job fails.

A trainer's torchelastic error file (``<run dir>/gen<G>/rank<R>/error.json``, written by ftrun's bootstrap or the
script's ``@record``) gives a failure its reason's detail and its signature (:data:`MAX_SIGNATURE` characters at
most, compared to tell a crash loop); a SIGKILL is noted as a likely OOM kill when the kernel's OOM killer ran
since the trainers started; a message that names a broken connection (:data:`PEER_ERRORS`) marks a crash that
may be another node's loss. When the job fails, the supervisor of the failure's node copies that trainer's error
file to the ``TORCHELASTIC_ERROR_FILE`` ftrun was started with (:func:`record_root_cause`), as torchrun does.
Nothing here raises: an unreadable error file is no error file.
"""

from __future__ import annotations

import json
import os
import signal
import time

from ftrun.control.coordination import Generation
from ftrun.errors import error_text
from ftrun.events import EventLog
from ftrun.launch.env import ENV_ERROR_FILE
from ftrun.launch.processes import oom_kills

# An error that names a broken connection (lowercase) waits for another node's loss to be declared first
# (Supervisor._wait_for_lost_node)
PEER_ERRORS = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited",
               "ncclremoteerror", "distnetworkerror")
MAX_SIGNATURE = 2000  # characters of an error file's message kept as a failure's signature


def peer_error(message: str) -> bool:
    """Whether a trainer's error says another node's end of a connection failed (gloo, NCCL, c10d), as when
    that node is lost whole."""
    lowered = message.lower()
    return any(words in lowered for words in PEER_ERRORS)


def error_file(run_dir: str, gen: int, rank: int) -> str:
    """The torchelastic error file of global rank ``rank`` in generation ``gen``."""
    return os.path.join(run_dir, f"gen{gen}", f"rank{rank}", "error.json")


def error_message(run_dir: str, gen: int, rank: int) -> str:
    """The message of the trainer's torchelastic error file ("Type: message", written by ftrun's bootstrap or
    the script's ``@record``); "" when it wrote none."""
    try:
        with open(error_file(run_dir, gen, rank)) as f:
            message = json.load(f)["message"]
        text = message["message"] if isinstance(message, dict) else message
        return str(text).strip()[:MAX_SIGNATURE]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def oom_note(code: int, kills_at_start: int | None) -> str:
    """For a trainer killed by SIGKILL: that the kernel's OOM killer ran since the trainers started (a SIGKILL
    says nothing else of who sent it); ``kills_at_start``: the host's count of OOM kills then (None: not
    counted)."""
    if code != -signal.SIGKILL or kills_at_start is None or (oom_kills() or 0) <= kills_at_start:
        return ""
    return " (out of memory? the kernel's OOM killer ran since the trainers started)"


def record_root_cause(last: Generation, node: int, run_dir: str, exit_codes: dict[tuple[int, int], int],
                      events: EventLog) -> None:
    """A failed job's cause, in torchelastic's error-file format, at the ``TORCHELASTIC_ERROR_FILE`` ftrun was
    started with (as torchrun copies its root-cause child's there, for TorchX and other schedulers): the
    error file of the trainer whose failure ended the job, by the supervisor of its node (of node 0 when no
    node's failure did), else the failure's reason; with the trainer's exit code as ``errorCode`` when this node
    saw it (``exit_codes``: (generation, global rank) -> exit code; torchrun's agent adds it: a trainer cannot
    write the signal that killed it)."""
    target = os.environ.get(ENV_ERROR_FILE)
    if not target or (last.node if last.node is not None else 0) != node:
        return
    try:
        if last.rank is None:  # no trainer's failure (a lost node, a stop): the reason
            raise FileNotFoundError
        with open(error_file(run_dir, last.gen - 1, last.rank)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {"message": {"message": last.reason, "extraInfo": {"py_callstack": "",
                                                                     "timestamp": str(int(time.time()))}}}
    code = exit_codes.get((last.gen - 1, last.rank)) if last.rank is not None else None
    if code and isinstance(record, dict) and isinstance(record.get("message"), dict):
        record["message"]["errorCode"] = code
    try:
        with open(target, "w") as f:
            json.dump(record, f)
    except OSError as err:
        events.emit("error_file", f"cannot write the job's error file {target}: {error_text(err)}", node=node)


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:200]


def detail(message: str) -> str:
    """`` (Type: message)`` of a trainer's error file for a failure's reason ("" without one)."""
    return f" ({first_line(message)})" if message else ""
