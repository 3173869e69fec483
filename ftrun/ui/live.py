"""``ftrun status``: find a job, attach to its control store, and show its status once or live until it ends.

A job is found through the launcher files in the shared-memory directory (``ftrun-<job>-launcher``, JSON with
the control store's endpoint; see :func:`ftrun.launch.launcher.announce_job`) or at an explicit endpoint. The
viewer only reads the store, authenticated like every reader (:mod:`ftrun.control.signed`): with the secret the
job's launcher left on this host (``ftrun-<job>-secret``), else the one derived from ``--secret-file`` and the
job id as multi-node jobs do; values that do not verify are ignored with a warning on stderr. :class:`LiveView` is
the refreshing view, also usable by a launcher (``--tui``).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Protocol

from rich.console import Console
from rich.live import Live

from ftrun.errors import UsageError
from ftrun.control.coordination import Coordinator, incarnation_key, use_job
from ftrun.control.secret import read_secret_file, shared_secret
from ftrun.control.spec import shm_dir, split_endpoint
from ftrun.control.backend import StoreAddress, open_store
from ftrun.control.store import C10dStore
from ftrun.ui.status import PUBLISH_INTERVAL, JobStatus, gather
from ftrun.ui.summary import Recovery
from ftrun.ui.view import ENDED, render

POLL_INTERVAL = PUBLISH_INTERVAL  # how often a live view gathers the job's status
WATCHED = "watched"  # key a live view sets: the launcher then keeps the store up for two more polls at the end
PLAIN_INTERVAL = 1.0  # how often a view that is not a terminal prints it
CONNECT_TIMEOUT = 3.0  # seconds to wait for an unreachable store before it is an error
STORE_TIMEOUT = timedelta(seconds=5)  # a store operation slower than this means the store is gone


@dataclass(frozen=True)
class Announced:
    """A launcher file: a job running on this host and its control store."""

    job: str
    endpoint: str
    nnodes: int
    pid: int
    backend: str = "c10d"


class View(Protocol):
    """Where a followed job's status goes."""

    def update(self, status: JobStatus) -> None: ...

    def close(self, message: str | None = None) -> None: ...


class Periodic:
    """Hands the newest status to ``emit`` at most once per ``interval`` (None: never by itself); :meth:`flush`
    hands over the last one if it was not yet."""

    def __init__(self, emit: Callable[[JobStatus], None], interval: float | None = PLAIN_INTERVAL) -> None:
        self.emit = emit
        self.interval = interval
        self._emitted = float("-inf")
        self._pending: JobStatus | None = None

    def update(self, status: JobStatus) -> None:
        self._pending = status
        if self.interval is not None and time.monotonic() - self._emitted >= self.interval:
            self.flush()

    def flush(self) -> None:
        if self._pending is not None:
            self.emit(self._pending)
            self._pending, self._emitted = None, time.monotonic()


class LiveView:
    """The status view, redrawn in place on a terminal (rich ``Live``), else printed as plain text every
    ``plain_interval`` seconds (None: once, at the end).

    ``update(status)`` as often as wanted (twice a second is the supervisors' pace); ``close(message)`` once at
    the end: it leaves the last view on the screen and prints ``message`` (e.g. "job ended: done") below it.
    """

    def __init__(self, console: Console, plain_interval: float | None = PLAIN_INTERVAL) -> None:
        self.console = console
        self._live: Live | None = None
        self._plain = Periodic(self._print, plain_interval)
        if console.is_terminal:
            self._live = Live(console=console, auto_refresh=False, transient=False, vertical_overflow="ellipsis")
            self._live.start()

    def update(self, status: JobStatus) -> None:
        """Show ``status``: at once on a terminal, else when the last plain print is ``plain_interval`` old (or
        at :meth:`close`)."""
        if self._live is not None:
            self._live.update(render(status, self.console.width), refresh=True)
        else:
            self._plain.update(status)

    def close(self, message: str | None = None) -> None:
        """Stop refreshing, keep the last view visible (printing it if it was not yet) and print ``message``."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._plain.flush()
        if message:
            self.console.print(message, highlight=False)

    def _print(self, status: JobStatus) -> None:
        self.console.print(render(status, self.console.width))
        self.console.print()


class JsonLines:
    """``--json`` without ``--once``: one JSON document a line on stdout, at most one a second; the closing
    message goes to stderr."""

    def __init__(self, interval: float = PLAIN_INTERVAL) -> None:
        self._periodic = Periodic(lambda status: print(json.dumps(status.to_json()), flush=True), interval)

    def update(self, status: JobStatus) -> None:
        self._periodic.update(status)

    def close(self, message: str | None = None) -> None:
        self._periodic.flush()
        if message:
            print(message, file=sys.stderr, flush=True)


class AmbiguousJob(UsageError):
    """Several jobs run on this host and none was chosen: waiting would not help."""


def announced_jobs() -> list[Announced]:
    """The jobs whose launcher runs on this host, by their launcher files (stale and unreadable ones skipped)."""
    found = []
    for path in sorted(glob.glob(os.path.join(shm_dir(), "ftrun-*-launcher"))):
        try:
            with open(path) as f:
                doc = json.load(f)
            job = Announced(str(doc["job"]), str(doc["endpoint"]), int(doc["nnodes"]), int(doc["pid"]),
                            str(doc.get("backend", "c10d")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(job.pid):
            found.append(job)
    return found


def find_job(job: str | None, preferred: str | None = None) -> Announced:
    """The running job of this host named ``job``; when ``job`` is None, job ``preferred`` (the SLURM job's own,
    inside one) if it runs here, else the only one."""
    jobs = announced_jobs()
    if job is not None:
        for found in jobs:
            if found.job == job:
                return found
        raise UsageError(f"no running job {job!r} found on this host"
                         + (f" (running: {', '.join(j.job for j in jobs)})" if jobs else "")
                         + "; for a job elsewhere give --endpoint HOST:PORT")
    if not jobs:
        raise UsageError("no running ftrun job found on this host; for a job elsewhere give --endpoint HOST:PORT "
                         "--job ID")
    for found in jobs:
        if found.job == preferred:
            return found
    if len(jobs) > 1:
        raise AmbiguousJob(f"several jobs run on this host ({', '.join(j.job for j in jobs)}): choose one with --job")
    return jobs[0]


def attach(endpoint: str | None, job: str | None, timeout: float = CONNECT_TIMEOUT,
           secret_file: str | None = None, backend: str = "c10d", preferred: str | None = None) -> Coordinator:
    """A read-only coordinator of the job, found as the module docstring says (``preferred``: see
    :func:`find_job`); every failure is a UsageError."""
    if endpoint is None:
        found = find_job(job, preferred)
        endpoint, job, nnodes, backend = found.endpoint, found.job, found.nnodes, found.backend
    elif job is None:
        raise UsageError("--job is needed with --endpoint")
    else:
        nnodes = None
    for member in endpoint.split(","):
        try:
            split_endpoint(member)
        except UsageError:
            raise UsageError(f"--endpoint must be HOST:PORT[,HOST:PORT...], got {endpoint!r}") from None
    store = open_store(StoreAddress(backend, endpoint), timeout)
    if isinstance(store, C10dStore):
        store.tcp.set_timeout(STORE_TIMEOUT)
    if not store.check([incarnation_key(job)]):
        raise UsageError(f"no job {job!r} at the control store {endpoint}")
    secret = read_secret_file(job) or shared_secret(job, secret_file, create=False)
    use_job(job, secret, lambda message: print(f"ftrun: {message}", file=sys.stderr, flush=True))
    doc = Coordinator(store, job, 0, 1).job_doc()
    if doc is None:
        raise UsageError(f"no job {job!r} at the control store {endpoint} (or none this secret authenticates)")
    return Coordinator(store, job, 0, nnodes or int(doc["nnodes"]))


def attach_waiting(endpoint: str | None, job: str | None, secret_file: str | None = None,
                   backend: str = "c10d", preferred: str | None = None) -> Coordinator:
    """:func:`attach`, retried every :data:`POLL_INTERVAL` until the job appears (a message says so once)."""
    waiting = False
    while True:
        try:
            return attach(endpoint, job, timeout=POLL_INTERVAL, secret_file=secret_file, backend=backend,
                          preferred=preferred)
        except AmbiguousJob:
            raise
        except UsageError:
            if not waiting:
                what = f"job {job}" if job else "a job"
                print(f"ftrun: waiting for {what} (Ctrl-C to stop)", file=sys.stderr, flush=True)
                waiting = True
        time.sleep(POLL_INTERVAL)


def follow(coord: Coordinator, view: View) -> None:
    """Update ``view`` until the job ends or its store goes away, then close it with the line that says which."""
    message = None
    try:
        message = _follow(coord, view)
    finally:
        view.close(message)


def _follow(coord: Coordinator, view: View) -> str:
    coord.store.set(coord.key(WATCHED), "1")  # the launcher keeps the store up long enough to show the end
    settled: dict[int, Recovery] = {}
    while True:
        try:
            status = gather(coord, settled=settled)
        except RuntimeError:  # torch's DistError family: the store closed or stopped answering
            return "control store gone"
        view.update(status)
        if status.state in ENDED:
            return f"job ended: {status.state}"
        time.sleep(POLL_INTERVAL)


def status_command(endpoint: str | None, job: str | None, as_json: bool, once: bool, wait: bool,
                   secret_file: str | None = None, backend: str = "c10d", preferred: str | None = None) -> int:
    """``ftrun status``: the job's status once (a table, or JSON) or live until it ends; returns the exit code.
    ``preferred``: the job shown when no ``job`` is given and several run on this host (:func:`find_job`)."""
    coord = (attach_waiting(endpoint, job, secret_file, backend, preferred) if wait
             else attach(endpoint, job, secret_file=secret_file, backend=backend, preferred=preferred))
    console = Console() if sys.stdout.isatty() else Console(force_terminal=False, no_color=True)
    if once:
        try:
            status = gather(coord)
        except RuntimeError:
            raise UsageError("the control store went away while reading the job's status") from None
        if as_json:
            print(json.dumps(status.to_json()), flush=True)
        else:
            console.print(render(status, console.width))
        return 0
    follow(coord, JsonLines() if as_json else LiveView(console))
    return 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a launcher killed by SIGKILL leaves its file behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True
