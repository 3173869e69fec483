"""The durable tier as it is: the newest complete step on disk and how far behind training it is, and how
persisting went (the counts node 0 keeps in the control store: :mod:`ftrun.snapshot.durability`).

Read from the checkpoint directory itself when this host sees it (the job document names it), else from what
node 0 last wrote to the store; shown by the summary and by ``ftrun status``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

from ftrun.control.coordination import Coordinator
from ftrun.snapshot.durability import dcp_failure, number
from ftrun.snapshot.persist import complete_steps, manifest


@dataclass(frozen=True)
class DiskState:
    """What is on disk for a job, and how its persists went."""

    step: int | None  # newest complete step of the job on disk (None: none)
    age: float | None  # seconds since that step was written
    behind: int | None  # steps it lags the newest globally committed step
    rounds: int  # persists finished, written or failed
    failures: int
    reason: str  # why the last failed persist failed ("" when none did)
    failing: bool  # the newest persist failed: no persist has succeeded since (a disk freed again is not)
    copy_failed: tuple[int, str] | None = None  # --ckpt-format dcp: (step, why) of the newest DCP copy that failed,
    # while no newer one is written
    copied: int | None = None  # --ckpt-format dcp: the newest step with a DCP copy (None: none, or not that format)

    @property
    def degraded(self) -> bool:
        """Whether the newest persist, or the newest DCP copy, failed."""
        return self.failing or self.copy_failed is not None

    def where(self) -> str:
        if self.step is None:
            return "no step on disk"
        lag = ([f"{self.behind} step(s) behind training"] if self.behind is not None else []) + (
            [f"written {self.age:.1f}s ago"] if self.age is not None else [])
        return f"newest step on disk {self.step}" + (f" ({', '.join(lag)})" if lag else "")

    def describe(self) -> str:
        """One line: "ok: newest step on disk 60 (0 step(s) behind training, written 1.2s ago)" (with "; 1 of 9
        persists failed before (last: ...)" when the disk came back), or "DEGRADED: 3 of 9 persists failed (last: No
        space left on device); newest step on disk 20 (...)"."""
        failed = f"{self.failures} of {self.rounds} persists failed"
        problems = [f"{failed} (last: {self.reason})"] if self.failing else []
        if self.copy_failed is not None:
            newest = f"step {self.copied}" if self.copied else "none"
            problems.append(f"the DCP copy of step {self.copy_failed[0]} failed ({self.copy_failed[1]}; newest DCP "
                            f"copy: {newest})")
        if problems:
            return f"DEGRADED: {'; '.join(problems)}; {self.where()}"
        return f"ok: {self.where()}" + (f"; {failed} before (last: {self.reason})" if self.failures else "")


def disk_state(coord: Coordinator, committed: int, now: float | None = None) -> DiskState | None:
    """The job's :class:`DiskState` (``committed``: its newest globally committed step); None without a
    checkpoint directory."""
    now = time.time() if now is None else now
    root = (coord.job_doc() or {}).get("ckpt_dir")
    if not isinstance(root, str):
        return None
    done, written = number(coord.get("persist", "done")), number(coord.get("persist", "done_time"), float)
    step = int(done) if done is not None else None
    with contextlib.suppress(OSError, ValueError):
        on_disk = complete_steps(root, coord.job_id)
        step = on_disk[-1] if on_disk else None
        written = manifest(root, step)["time"] if step is not None else None
    reason = coord.get("persist", "failed_reason")
    copied, copy_failed = number(coord.get("persist", "dcp_done")), dcp_failure(coord.get("persist", "dcp_failed"))
    if copy_failed is not None and copy_failed[0] <= (copied or 0):  # a replacement node 0 wrote a newer copy since
        copy_failed = None
    return DiskState(step, now - written if written is not None else None,
                     max(0, committed - step) if step is not None and committed else None,
                     int(number(coord.get("persist", "rounds")) or 0),
                     int(number(coord.get("persist", "failures")) or 0),
                     reason.decode(errors="replace") if reason else "",
                     bool(coord.get("persist", "degraded")), copy_failed, copied)


def newest_committed(coord: Coordinator) -> int:
    """The newest globally committed step any node's status document reports (0: none)."""
    newest = 0
    for node in range(coord.nnodes):
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            newest = max(newest, int(json.loads(coord.get("status", "node", node) or b"{}").get("committed", 0)))
    return newest
