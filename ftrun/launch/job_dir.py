"""A launcher's checks of the job's ``--ckpt-dir`` directory before anything starts, and its hold on it.

- :func:`hold_job_dir`: refuse to start beside a live run of the job that holds it, or where it is no directory;
  resuming, repair it and check the newest persisted step can be loaded at this run's world size
  (:func:`check_world_on_disk`); node 0 holds it for the run (:func:`take_job_dir`, :mod:`ftrun.snapshot.dir_owner`).
- :func:`move_steps_aside`: ``--no-resume`` keeps the job's persisted steps, moved aside, not resumed from.

Invariants: nothing here deletes a complete step (unfinished ones only); a DCP copy that fails its check is
renamed ``dcp.corrupt``, kept; every repair and every step not resumed from is said in one event line.
"""

from __future__ import annotations

import os

from ftrun.errors import UsageError, error_text
from ftrun.events import EventLog
from ftrun.snapshot.dcp_copy import dcp_problem, newest_dcp
from ftrun.snapshot.dir_owner import DirOwner, check as check_dir_owner
from ftrun.snapshot.persist import (complete_steps, manifest, move_aside, put_back_replaced, remove_partial,
                                    step_dirs, step_name, steps_text)


def hold_job_dir(root: str, run_id: str, job_id: str, world: int | None, node_rank: int, events: EventLog,
                 slurm_job: str) -> DirOwner | None:
    """Refuse to start beside a live run of this job that holds ``root``, or where ``root`` is there but is no
    directory (a file, a link to none or a loop: nothing could be persisted), a UsageError; resuming (``world``:
    this run's world size, None when not resuming) check it (:func:`check_world_on_disk`); on node 0, hold it for
    this run (returned), after the checks and repairs of a resume. ``slurm_job``: the SLURM job id, "" outside."""
    if os.path.lexists(root) and not os.path.isdir(root):
        raise UsageError(f"--ckpt-dir: this job's directory {root} is not a directory (a file, or a link that "
                         "leads to none): nothing could be persisted there; move it away")
    dead = check_dir_owner(root, run_id, job_id, lambda line: events.emit("ckpt_dir", line), slurm_job)
    if dead is not None:
        events.emit("ckpt_dir", f"{root} was held by a run of job {job_id} that is gone ({dead.describe()}): taken "
                    "over", host=dead.host, pid=dead.pid)
    if world is not None:
        check_world_on_disk(root, job_id, world, events)
    return take_job_dir(root, run_id, events, slurm_job) if node_rank == 0 else None


def take_job_dir(root: str, run_id: str, events: EventLog, slurm_job: str) -> DirOwner:
    """Hold ``root`` for run ``run_id`` until the returned :class:`DirOwner` is closed (the launcher's end)."""
    owner = DirOwner(root, run_id, lambda line: events.emit("ckpt_dir", f"WARNING {line}"), slurm_job)
    owner.take()
    return owner


def check_world_on_disk(root: str, job_id: str, world: int, events: EventLog) -> None:
    """Resuming: the newest persisted step of this job was saved at this run's ``world`` size, or has a copy in
    DCP's format (``ftrun.dcp.MemoryReader`` reshards it); else a UsageError, before anything starts. First the
    directory is repaired: a step moved aside by an unfinished second persist is put back, and unfinished steps
    are removed (they could fill the disk until the run reached their step again; a launcher joining a running job
    at worst fails one persist round, which the next retries)."""
    put_back_replaced(root)  # a step moved aside by a second persist of it that did not finish
    unfinished = step_dirs(root, partial=True)  # an earlier run's, killed while it persisted: no round runs yet
    for step in unfinished:
        remove_partial(root, step)
    if unfinished:
        events.emit("resume", f"removed {len(unfinished)} unfinished step(s) an earlier run of job {job_id} left "
                    f"in {root} ({steps_text(unfinished)})", steps=unfinished)
    steps = complete_steps(root, job_id)
    report_unreadable_steps(root, job_id, steps[-1] if steps else -1, events)
    if not steps:
        return
    newest = steps[-1]
    try:
        saved = manifest(root, newest)["world"]
    except (OSError, ValueError):
        return  # a corrupt step is reported (and not loaded) by the restore
    if saved == world:
        return
    copied = checked_dcp(root, events)  # the newest step's, else an older one's (a job killed while it wrote it)
    if copied is not None:
        step, path = copied
        which = "its DCP copy" if step == newest else f"the newest DCP copy, step {step}'s"
        events.emit("resume", f"job {job_id}: the newest persisted step, {newest}, was saved at world size {saved} "
                    f"and this run has {world}: ftrun.dcp.MemoryReader loads {which} ({path}), resharded; a "
                    f"Snapshotter restores only at world size {saved}", step=newest, dcp_step=step,
                    saved_world=saved, world=world)
        return
    raise UsageError(f"cannot resume job {job_id} from {root}: its newest persisted step, {newest}, was saved "
                     f"at world size {saved} and this run has {world}; ftrun resumes at the same world size, or "
                     "from a step persisted with --ckpt-format dcp (resharded by ftrun.dcp.MemoryReader); start "
                     "afresh with --no-resume (the steps are moved aside, kept)")


def checked_dcp(root: str, events: EventLog) -> tuple[int, str] | None:
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


def report_unreadable_steps(root: str, job_id: str, newest: int, events: EventLog) -> None:
    """One line when step directories newer than ``newest``, the newest complete step, are not steps of job
    ``job_id`` (a manifest missing, edited, or another job's): the resume goes past them, and says so."""
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
    events.emit("resume", f"WARNING {which} not resumed from: {step_name(skipped[-1])} is not a complete step of "
                f"this job ({reason})", steps=skipped, newest=newest)


def move_steps_aside(root: str, job_id: str, events: EventLog) -> None:
    """--no-resume: move this job's persisted steps into ``previous-<time>/`` (kept, but not resumed from)."""
    steps = complete_steps(root, job_id)
    if not steps:
        return
    aside = move_aside(root, [os.path.join(root, step_name(step)) for step in steps])
    events.emit("no_resume", f"--no-resume: moved {len(steps)} persisted step(s) of job {job_id} (newest "
                f"{steps[-1]}) to {aside}", steps=steps, path=aside)
