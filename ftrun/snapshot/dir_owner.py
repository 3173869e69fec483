"""One run at a time writes a job's checkpoint directory.

Two runs of one job (one ``--rdzv-id``) that share a ``--ckpt-dir`` (a job started twice on two hosts, a SLURM
requeue while the old allocation still runs) would persist into, prune and move aside each other's steps, and
could even mix their ranks in one step. So node 0's launcher of a run *holds* ``<job dir>/.owner``, a JSON
:class:`Holder` naming the run (a random id that every launcher of the run reads from the control store's job
document), the host and the process, and a beat counter::

    {"run": "9f0c...", "host": "gpu-17", "boot": "<boot id>", "pidns": "pid:[4026531836]", "pid": 4242,
     "started": 1795000000.25, "beat": 17, "slurm": "81234"}

Protocol:

* The holder rewrites it (a temporary file renamed over it) with ``beat`` + 1 every :data:`REFRESH` seconds
  while it runs, and removes it when its run ends.
* Before any launcher touches the directory (resume's repairs, ``--no-resume``'s move aside) it *checks* the
  record: absent, unreadable, or of its own run: go on. Of another run: that run is dead when its holder's host
  is this host (same boot id and pid namespace) and its process is gone, or when its beat does not change for
  :data:`STALE_AFTER` seconds. That wait is shortened by the record's age on the file server's own clock (the
  record's mtime against that of a file just written beside it), so no two hosts' clocks are ever compared, and
  a record left by a run dead for longer costs no wait. Nor does one of an earlier step of the same SLURM job
  (``slurm``): ftrun's batch loop runs a job's steps one after the other, and a requeue ends the allocation. A
  live one refuses the start with a one-line :class:`~ftrun.errors.UsageError` naming its host and process.
* A run's node 0 then takes the record, and a replacement node 0 of the same run takes it over (same run id).
  A holder that finds the record taken by another run (it stalled for longer than :data:`STALE_AFTER`, and a
  new run judged it dead) says so once and stops rewriting it.

Files only (no store, no torch): the launcher passes the run id in.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import psutil

from ftrun.control.spec import boot_id
from ftrun.errors import UsageError, error_text
from ftrun.snapshot.persist import mkdir_private, open_regular, private

OWNER_FILE = ".owner"
REFRESH = 2.0  # seconds between two beats of the holder
STALE_AFTER = 15.0  # seconds without a beat after which a holder on another host is dead
POLL = 0.25  # seconds between two reads of another run's record while waiting for its beat
MAX_RECORD_BYTES = 64 << 10


@dataclass(frozen=True)
class Holder:
    """The launcher that holds a job's directory, and its beat."""

    run: str  # the run's id: every launcher of one run has the same
    host: str
    boot: str  # /proc/sys/kernel/random/boot_id
    pidns: str  # the holder's pid namespace: its pid means nothing outside it
    pid: int
    started: float  # the holder process's start time (psutil), against a reused pid
    beat: int = 0
    slurm: str = ""  # the SLURM job id of its step ("": not under SLURM)

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}"


def this_process(run: str, slurm: str = "") -> Holder:
    """A :class:`Holder` for this process in ``run`` (in a step of SLURM job ``slurm``)."""
    return Holder(run, socket.gethostname(), boot_id(), _pid_namespace(), os.getpid(),
                  psutil.Process().create_time(), slurm=slurm)


def owner_path(root: str) -> str:
    return os.path.join(root, OWNER_FILE)


def read_holder(root: str) -> tuple[Holder, float] | None:
    """The record in ``root`` and its mtime; None when there is none or it is not one (a holder never leaves a
    half-written record: it renames a whole one into place)."""
    try:
        with open_regular(owner_path(root)) as f:
            mtime = os.fstat(f.fileno()).st_mtime
            raw = f.read(MAX_RECORD_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
        holder = Holder(**doc) if isinstance(doc, dict) else None
        ok = holder is not None and all(isinstance(getattr(holder, name), kind) for name, kind in
                                        (("run", str), ("host", str), ("boot", str), ("pidns", str), ("pid", int),
                                         ("started", (int, float)), ("beat", int), ("slurm", str)))
    except (OSError, ValueError, TypeError, RecursionError):
        return None
    return (holder, mtime) if ok and holder is not None else None


def check(root: str, run: str, job: str, say: Callable[[str], None], slurm: str = "",
          stale_after: float = STALE_AFTER) -> Holder | None:
    """Raise :class:`UsageError` if a live run other than ``run`` (in a step of SLURM job ``slurm``) holds
    ``root``; else return the dead run's :class:`Holder` it found (None: none, or ``run`` itself). Waits for the
    other run's beat for at most ``stale_after`` seconds, less the record's age, and tells ``say`` so first."""
    found = read_holder(root)
    if found is None or found[0].run == run:
        return None
    holder, mtime = found
    if slurm and holder.slurm == slurm:
        return holder  # an earlier step of this SLURM job: its steps run one after the other, and a requeued job
        # runs again only once its allocation ended
    alive = _alive_here(holder)
    if alive is not None:
        if alive:
            raise UsageError(_busy(root, job, holder, _age(root, mtime)))
        return holder
    wait = max(0.0, stale_after - _age(root, mtime))
    if wait > 0:
        say(f"{root} is held by another run of job {job} ({holder.describe()}): waiting up to {wait:.0f} s for a "
            "sign of life from it before taking it over")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(POLL)
        now = read_holder(root)
        if now is None or now[0].run == run:
            return None
        if now[0] != holder:  # it beat, or another run took it
            raise UsageError(_busy(root, job, now[0], _age(root, now[1])))
    return holder


class DirOwner:
    """Holds ``root`` for ``run`` (see the module docstring): :meth:`take`, then :meth:`close` when the run ends.
    ``say`` gets one line when the record cannot be written, or was taken by another run."""

    def __init__(self, root: str, run: str, say: Callable[[str], None], slurm: str = "",
                 refresh: float = REFRESH) -> None:
        self.root, self.refresh, self.say = root, refresh, say
        self.holder = this_process(run, slurm)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        """Write the record and start beating (a daemon thread)."""
        try:
            mkdir_private(self.root)
            self._write(self.holder)
        except OSError as err:
            self.say(f"cannot write {owner_path(self.root)} ({error_text(err)}): another run of this job sharing "
                     "the directory would not be refused")
            return
        self._thread = threading.Thread(target=self._beat, name="ftrun-dir-owner", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop beating and remove the record if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            found = read_holder(self.root)
            if found is not None and self._mine(found[0]):
                with contextlib.suppress(OSError):
                    os.unlink(owner_path(self.root))

    def _beat(self) -> None:
        failed = False
        while not self._stop.wait(self.refresh):
            found = read_holder(self.root)
            if found is not None and not self._mine(found[0]):  # taken over: by this run's replacement node 0
                if found[0].run != self.holder.run:  # (its turn now), or by another run
                    self.say(f"{owner_path(self.root)} was taken by another run of this job ({found[0].describe()}) "
                             f"after this one did not beat for {STALE_AFTER:g} s: both runs now write "
                             f"{self.root}; stop one")
                return
            self.holder = replace(self.holder, beat=self.holder.beat + 1)
            try:
                self._write(self.holder)
            except OSError as err:  # the next beat tries again; said once
                if not failed:
                    self.say(f"cannot update {owner_path(self.root)}: {error_text(err)}")
                failed = True
            else:
                failed = False

    def _mine(self, holder: Holder) -> bool:
        return replace(holder, beat=0) == replace(self.holder, beat=0)

    def _write(self, holder: Holder) -> None:
        """Rename a whole record into place; a write that fails (a full disk) removes its temporary file."""
        temporary = f"{owner_path(self.root)}.{self.holder.host}.{self.holder.pid}"
        try:
            with open(temporary, "w", opener=private) as f:
                json.dump(asdict(holder), f)
            os.replace(temporary, owner_path(self.root))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def _busy(root: str, job: str, holder: Holder, age: float) -> str:
    return (f"job {job}'s checkpoint directory {root} is held by another run of the job ({holder.describe()}; "
            f"it beat {age:.0f} s ago): two runs would persist, prune and move aside each other's steps. Stop that "
            "run, or give this one another --rdzv-id or --ckpt-dir")


def _alive_here(holder: Holder) -> bool | None:
    """Whether ``holder``'s process lives, if it ran on this host in this pid namespace; else None."""
    if holder.host != socket.gethostname() or holder.boot != boot_id() or holder.pidns != _pid_namespace():
        return None
    try:
        return abs(psutil.Process(holder.pid).create_time() - holder.started) < 0.5
    except psutil.Error:
        return False


def _age(root: str, mtime: float) -> float:
    """Seconds since ``mtime`` on the clock of ``root``'s file system (0 when no file can be written there)."""
    probe = os.path.join(root, f"{OWNER_FILE}.probe.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "w", opener=private) as f:
            now = os.fstat(f.fileno()).st_mtime
    except OSError:
        return 0.0
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return max(0.0, now - mtime)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
