"""What a launcher does to a job's checkpoint directory before its run: the checks and repairs of a resume, and
``--no-resume`` moving the persisted steps aside.

Invariants: nothing persisted is deleted here but the unfinished steps an earlier run left (a step is complete
once its manifest is written; an unfinished one could never be loaded); a step that cannot be resumed from is
reported in one line and kept; a run that cannot resume (another world size and no DCP copy) is a UsageError
before anything starts.
"""

from __future__ import annotations

import os

from ftrun.errors import UsageError, error_text
from ftrun.events import EventLog
from ftrun.snapshot.dcp_copy import dcp_problem, newest_dcp
from ftrun.snapshot.persist import (complete_steps, manifest, move_aside, put_back_replaced, remove_partial, step_dirs,
                                    step_name, steps_text)


def prepare_resume(root: str, job_id: str, world: int, events: EventLog) -> None:
    """Resuming job ``job_id`` from ``root``: its newest persisted step was saved at this run's ``world`` size,
    or has a copy in DCP's format (``ftrun.dcp.MemoryReader`` reshards it); else a UsageError, before anything
    starts. First the directory is repaired: a step moved aside by an unfinished second persist is put back, and
    unfinished steps are removed (they could fill the disk until the run reached their step again; a launcher
    joining a running job at worst fails one persist round, which the next retries)."""
    put_back_replaced(root)  # a step moved aside by a second persist of it that did not finish
    unfinished = step_dirs(root, partial=True)  # an earlier run's, killed while it persisted: no round runs yet
    for step in unfinished:
        remove_partial(root, step)
    if unfinished:
        events.emit("resume", f"removed {len(unfinished)} unfinished step(s) an earlier run of job "
                    f"{job_id} left in {root} ({steps_text(unfinished)})", steps=unfinished)
    steps = complete_steps(root, job_id)
    _report_unreadable_steps(root, steps[-1] if steps else -1, events)
    if not steps:
        return
    newest = steps[-1]
    try:
        saved = manifest(root, newest)["world"]
    except (OSError, ValueError):
        return  # a corrupt step is reported (and not loaded) by the restore
    if saved == world:
        return
    copied = _checked_dcp(root, events)  # the newest step's, else an older one's (a job killed while it wrote it)
    if copied is not None:
        step, path = copied
        which = "its DCP copy" if step == newest else f"the newest DCP copy, step {step}'s"
        events.emit("resume", f"job {job_id}: the newest persisted step, {newest}, was saved at world "
                    f"size {saved} and this run has {world}: ftrun.dcp.MemoryReader loads {which} ({path}), "
                    f"resharded; a Snapshotter restores only at world size {saved}", step=newest,
                    dcp_step=step, saved_world=saved, world=world)
        return
    raise UsageError(f"cannot resume job {job_id} from {root}: its newest persisted step, {newest}, was saved "
                     f"at world size {saved} and this run has {world}; ftrun resumes at the same world size, or "
                     "from a step persisted with --ckpt-format dcp (resharded by ftrun.dcp.MemoryReader); start "
                     "afresh with --no-resume (the steps are moved aside, kept)")


def _checked_dcp(root: str, events: EventLog) -> tuple[int, str] | None:
    """(step, path) of the newest DCP copy in ``root`` that passes its check, or None. Each newer one that fails
    is renamed ``dcp.corrupt`` (kept, never loaded: the trainers' ``MemoryReader`` no longer sees it), unless
    another launcher of the run (a shared file system) just did."""
    while (copied := newest_dcp(root)) is not None and (problem := dcp_problem(copied[1])) is not None:
        try:
            os.rename(copied[1], copied[1] + ".corrupt")
        except FileNotFoundError:
            continue
        except OSError as err:
            raise UsageError(f"the DCP copy {copied[1]} is corrupt ({problem}) and cannot be moved aside: "
                             f"{error_text(err)}") from None
        events.emit("resume", f"WARNING the DCP copy of step {copied[0]} is corrupt ({problem}): not loaded, "
                    f"moved to {copied[1]}.corrupt", step=copied[0], reason=problem)
    return copied


def _report_unreadable_steps(root: str, newest: int, events: EventLog) -> None:
    """One line when step directories newer than the newest complete step are not steps of this job (a
    manifest missing, edited, or another job's): the resume goes past them, and says so."""
    skipped = [step for step in step_dirs(root) if step > newest]
    if not skipped:
        return
    try:
        reason = f"a step of job {manifest(root, skipped[-1])['job']!r}"
    except (OSError, ValueError) as err:
        reason = error_text(err)
    which = f"{len(skipped)} step director{'y' if len(skipped) == 1 else 'ies'} in {root}"
    if newest >= 0:
        which += f" newer than its newest complete step, {newest},"
    events.emit("resume", f"WARNING {which} not resumed from: {step_name(skipped[-1])} is not a complete "
                f"step of this job ({reason})", steps=skipped, newest=newest)


def move_steps_aside(root: str, job_id: str, events: EventLog) -> None:
    """--no-resume: move this job's persisted steps into ``previous-<time>/`` (kept, but not resumed from)."""
    steps = complete_steps(root, job_id)
    if not steps:
        return
    aside = move_aside(root, [os.path.join(root, step_name(step)) for step in steps])
    events.emit("no_resume", f"--no-resume: moved {len(steps)} persisted step(s) of job {job_id} "
                f"(newest {steps[-1]}) to {aside}", steps=steps, path=aside)
