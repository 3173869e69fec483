"""The end-of-job summary: every failure, how it was seen, what was restored and how long recovery took.

Read from the control store."""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.control.coordination import Coordinator, Generation
from ftrun.control.ownership import SpareDoc, spares
from ftrun.control.spec import STEP_END_KIND, STOP_KIND
from ftrun.ui.durable import disk_state, newest_committed


@dataclass(frozen=True)
class Recovery:
    """One restart: the failure that caused generation ``gen`` and the time until every rank beat again."""

    gen: int
    kind: str
    reason: str
    detected_by: str
    seconds: float | None  # None: not every rank beat again in that generation
    restored: tuple[int, str] | None  # the snapshot step restored and its source (step 0: none; None: not agreed)
    failed_step: int | None = None  # the failed rank's last reported step


SETTLED = 2  # a generation this many before the current one has its recovery row final (see recoveries())


def recoveries(coord: Coordinator, history: list[Generation] | None = None,
               settled: dict[int, Recovery] | None = None) -> list[Recovery]:
    """One row per restart of the job (of ``history``, read from the store when not given). ``settled``: rows
    a live view read before, of generations :data:`SETTLED` or more before the current one, whose marks and
    restore step no node writes any more: they are taken from it, and new ones added, so each refresh reads the
    store for the last generations only."""
    result = []
    gens = coord.history() if history is None else history
    for gen in gens:
        if gen.gen == 0 or gen.kind == STOP_KIND:  # a stop (a supervisor told to stop) is not a failure
            continue
        row = settled.get(gen.gen) if settled is not None else None
        if row is None:
            ups = coord.marks(gen.gen, "up")
            took = max(float(v) for v in ups.values()) - gen.time if len(ups) == coord.nnodes else None
            row = Recovery(gen.gen, gen.kind, gen.reason, gen.detected_by, took, coord.restore_step(gen.gen),
                           gen.step)
            if settled is not None and gens and gen.gen <= gens[-1].gen - SETTLED:
                settled[gen.gen] = row
        result.append(row)
    return result


def restart_count(rows: list[Recovery], max_restarts: object) -> int:
    """The failures that restarted the trainers: not a fatal error, nor the end of a SLURM step, nor the one past
    ``max_restarts`` (the job's limit, as in its ``job`` document) that ended the job."""
    limit = max_restarts if isinstance(max_restarts, int) else None
    return sum(row.kind not in ("fatal", STEP_END_KIND) and (limit is None or row.gen <= limit) for row in rows)


def print_summary(coord: Coordinator, exit_code: int, job_id: str, verdict: str | None = None) -> None:
    """The job's end as this launcher saw it: ``verdict`` (say, "succeeded"; by default from ``exit_code``), the
    failures and restarts, the durable tier, the spares, and a table of the recoveries."""
    # rich here, not at the top: the supervisors import this module (through ftrun.ui.status) and never print
    from rich.console import Console
    from rich.table import Table

    rows = recoveries(coord)
    console = Console(stderr=True, highlight=False, markup=False)  # reasons quote error messages: "[/path...]"
    verdict = verdict or ("succeeded" if exit_code == 0 else f"stopped by a signal (exit code {exit_code})"
                          if exit_code > 128 else f"failed (exit code {exit_code})")
    limit = (coord.job_doc() or {}).get("max_restarts")
    restarts = restart_count(rows, limit)
    over = isinstance(limit, int) and bool(rows) and rows[-1].gen > limit
    reached = f" (limit reached: --max-restarts {limit})" if over else ""
    console.print(f"ftrun: job {job_id} {verdict}: {len(rows)} failure(s), {restarts} restart(s){reached}",
                  soft_wrap=True)
    disk = disk_state(coord, newest_committed(coord))
    if disk is not None:
        console.print(f"ftrun: durability {disk.describe()}")
    for line in spare_lines(spares(coord)):
        console.print(f"ftrun: {line}", soft_wrap=True)
    if not rows:
        return
    table = Table(title="failures and recoveries", title_justify="left")
    table.add_column("gen", justify="right")
    table.add_column("failure")
    table.add_column("cause")
    table.add_column("seen by")
    table.add_column("restored")
    table.add_column("recovery", justify="right")
    for row in rows:
        took = f"{row.seconds:.2f} s" if row.seconds is not None else "-"
        restored = f"step {row.restored[0]} ({row.restored[1]})" if row.restored and row.restored[0] else "-"
        table.add_row(str(row.gen), row.kind, row.reason, row.detected_by, restored, took)
    console.print(table)


def spare_lines(docs: list[SpareDoc]) -> list[str]:
    """One line per spare that took a node rank, one for those ready, one for those that left unused."""
    lines = [f"spare {d.name} ({d.host}) took node rank {d.node} in generation {d.generation}"
             for d in docs if d.state == "took"]
    for state, words in (("waiting", "hot spare(s) ready"), ("gone", "spare(s) not needed")):
        names = [d.name for d in docs if d.state == state]
        if names:
            lines.append(f"{len(names)} {words}: {', '.join(names)}")
    return lines
