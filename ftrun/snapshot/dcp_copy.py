"""Node 0's copy of each persisted step in DCP's on-disk format (``--ckpt-format dcp``): ``<dir>/step-N/dcp``.

Once step N is complete on disk (:func:`ftrun.snapshot.persist.finalize`), a child process at the lowest CPU and
I/O priority (``python -m ftrun.snapshot.dcp_copy <dir> N``, :func:`main`; the final step's at the normal priority:
training is over, the job's end waits for it, and a busy host would starve an idle-priority one) exports it to
``<dir>/step-N/dcp.partial`` as ``ftrun export --format dcp`` does (:mod:`ftrun.snapshot.export`: every rank file
verified first, each DTensor written as its ranks' shards, never assembled in memory, the files checked against
DCP's metadata), and renames the directory to ``dcp`` itself when that succeeded. ``dcp.load(state,
checkpoint_id=<dir>/step-N/dcp)`` then reads it with torch alone, into any world size and sharding.

Invariants:

* A ``step-N/dcp`` directory is complete: only the child renames it, and only after its export succeeded. The
  parent goes by that directory, not by the child's exit code (a supervisor reaps every child that exits, and
  ``Popen`` then reports 0); it goes with its step when the step is pruned.
* A copy records the CRC-32 of each of its files (:data:`SUMS`) before it is renamed into place (DCP's own
  metadata has none: a flipped bit loads silently); :func:`dcp_problem` checks them, and a resume at another world
  size loads no copy that fails (the launcher moves it aside).
* One copy runs at a time, of the newest complete step asked for; a step finished meanwhile replaces an older
  one still waiting, and the job's final step (which its end waits for) stops an older one still running. A copy
  of a step pruned while it ran fails silently; any other failure is recorded (:attr:`DcpCopies.failure`, until a
  newer copy is written), and warned in one line until a copy is written again (the event log has every one; the
  ``ftrun`` format step stays complete and usable).
* The copy ends with the process that started it (the supervisor): it watches its parent, and exits, leaving its
  partial directory, once it has another (the supervisor was killed: its node was lost, or the launcher was
  killed and took it along), so nothing of a killed job goes on writing to its directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zlib

from ftrun.events import EventLog
from ftrun.snapshot.persist import complete_steps, private, step_name
from ftrun.snapshot.priority import spawn_lowered

DCP_DIR = "dcp"
PARENT_POLL = 0.1  # seconds between two looks of a copy at its parent
ENV_DCP_ROOT = "FTRUN_DCP_ROOT"  # a trainer's: its job's durable directory (--ckpt-dir)
SUMS = "ftrun-crc32.json"  # in a copy: {file name: CRC-32} of its other files
READ_CHUNK = 1 << 24


def newest_dcp(root: str) -> tuple[int, str] | None:
    """(step, path) of the newest complete DCP copy in the job directory ``root``, or None."""
    steps = [step for step in complete_steps(root) if os.path.isdir(dcp_path(root, step))]
    return (steps[-1], dcp_path(root, steps[-1])) if steps else None


def dcp_path(root: str, step: int) -> str:
    """Where step ``step`` of the job directory ``root`` has its DCP copy."""
    return os.path.join(root, step_name(step), DCP_DIR)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_sums(path: str) -> None:
    """Record the CRC-32 of every file of the copy in directory ``path`` in its :data:`SUMS` file (fsynced)."""
    sums = {name: _crc32(os.path.join(path, name)) for name in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, name))}
    with open(os.path.join(path, SUMS), "w", opener=private) as f:  # mode 0600, as the copy's other files
        json.dump(sums, f)
        f.flush()
        os.fsync(f.fileno())


def dcp_problem(path: str) -> str | None:
    """Why the copy in ``path`` fails its check (a file it recorded missing or of another CRC-32; its record
    unreadable), or None. A copy without a record (written before ftrun kept one) is not checked."""
    try:
        with open(os.path.join(path, SUMS)) as f:
            sums = json.load(f)
        for name, crc in sorted(sums.items()):
            if _crc32(os.path.join(path, name)) != crc:
                return f"{name} does not hold the bytes written (CRC-32 mismatch)"
    except FileNotFoundError as err:
        return None if err.filename == os.path.join(path, SUMS) else f"{os.path.basename(err.filename)} is missing"
    except (OSError, ValueError, AttributeError, TypeError) as err:
        return f"its {SUMS} or a file it names cannot be read ({err})"
    return None


class DcpCopies:
    """Node 0's DCP copies of the persisted steps of the job directory ``root``: :meth:`want` after each step is
    complete, :meth:`poll` every tick."""

    def __init__(self, root: str, events: EventLog) -> None:
        self.root = root
        self.events = events
        self._wanted = 0  # the newest complete step waiting for its copy
        self._final = False  # it is the job's final step
        self._running: tuple[int, subprocess.Popen[str], float] | None = None
        found = newest_dcp(root)
        self.done = found[0] if found else 0  # the newest step whose copy is complete (an earlier run's too)
        self.failure: tuple[int, str] | None = None  # (step, why) of the newest copy that failed, while none newer is

    def want(self, step: int, final: bool = False) -> None:
        """Copy ``step`` once the copy running ends; ``final``: the job's last, with training over: it starts at once,
        stopping a copy of an older step still running (the job's end waits for this one only), and is not
        lowered."""
        if final:
            self.stop()
        self._wanted = max(self._wanted, step)
        self._final = final
        self.poll()

    def spare(self) -> frozenset[int]:
        """The steps pruning must keep beyond ``--keep``: the one being copied (an export takes seconds; pruned
        meanwhile, no copy would ever complete while steps are persisted faster), and the newest with a copy, so
        that a job killed whole can always resume at another world size."""
        return frozenset(step for step in (self._running[0] if self._running else 0, self.done) if step)

    def busy(self) -> bool:
        """Whether a copy runs or waits to start (:meth:`poll` has work)."""
        return self._running is not None or self._wanted > self.done

    def poll(self) -> None:
        """Finish the running copy if it ended; start the next one."""
        if self._running is not None:
            step, child, t0 = self._running
            if child.poll() is None:
                return
            self._running = None
            self._ended(step, child, time.monotonic() - t0)
        if self._wanted > self.done:
            step, self._wanted = self._wanted, 0
            partial = dcp_path(self.root, step) + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            spawn = subprocess.Popen if self._final else spawn_lowered  # lowered as the keeper's persister thread
            child = spawn([sys.executable, "-m", __name__, self.root, str(step), str(os.getpid())],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self._running = step, child, time.monotonic()

    def _ended(self, step: int, child: subprocess.Popen[str], seconds: float) -> None:
        partial, path = dcp_path(self.root, step) + ".partial", dcp_path(self.root, step)
        error = (child.stderr.read() if child.stderr else "").strip().splitlines()
        if os.path.isdir(path):
            self.done = max(self.done, step)
            if self.failure is not None and self.failure[0] < step:
                self.failure = None
            self.events.emit("dcp", f"wrote step {step} in DCP format to {path} in {seconds:.2f}s", step=step,
                             path=path, seconds=seconds)
            return
        shutil.rmtree(partial, ignore_errors=True)
        if not os.path.isdir(os.path.join(self.root, step_name(step))):
            return  # pruned while it was copied: a newer step is on disk
        reason = error[-1].removeprefix("ftrun: error: ") if error else "its exporter ended without a word"
        warned, self.failure = self.failure is not None, (step, reason)
        self.events.emit("durability", f"WARNING the DCP copy of step {step} failed ({reason}); the step stays on "
                         f"disk in ftrun's format", console=not warned, step=step, degraded=True, reason=reason)

    def stop(self) -> None:
        """Stop a copy still running, and remove its partial directory."""
        if self._running is not None:
            step, child, _ = self._running
            child.kill()
            child.wait()
            self._running = None
            shutil.rmtree(dcp_path(self.root, step) + ".partial", ignore_errors=True)


def _exit_without(parent: int) -> None:
    """Exit this process (code 1) as soon as ``parent`` is no longer its parent: PR_SET_PDEATHSIG cannot say
    it, since a thread that ends, not the process, counts as the parent there (spawn_lowered's thread ends at
    once)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    os._exit(1)


def main(argv: list[str]) -> int:
    """``python -m ftrun.snapshot.dcp_copy ROOT STEP PARENT``: export step STEP of the job directory ROOT to
    ``step-N/dcp.partial`` and rename that to ``step-N/dcp``; 0 when the copy is in place, else 1 and one line.
    Stops, without renaming, once its parent is no longer process PARENT."""
    threading.Thread(target=_exit_without, args=(int(argv[2]),), daemon=True).start()
    from ftrun.errors import UsageError
    from ftrun.snapshot.export import export_step

    root, step = argv[0], int(argv[1])
    partial = dcp_path(root, step) + ".partial"
    try:
        for _ in export_step(root, partial, "dcp", step):
            pass
        write_sums(partial)
        os.rename(partial, dcp_path(root, step))
    except UsageError as err:
        print(f"ftrun: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"ftrun: error: cannot rename {partial}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
