"""The end-of-job summary: every failure, how it was seen, and how long recovery took, read from the store."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from ftrun.launch.coordination import Coordinator


@dataclass(frozen=True)
class Recovery:
    """One restart: the failure that caused generation ``gen`` and the time until every rank beat again."""

    gen: int
    kind: str
    reason: str
    detected_by: str
    seconds: float | None  # None: not every rank beat again in that generation


def recoveries(coord: Coordinator) -> list[Recovery]:
    result = []
    for gen in coord.history():
        if gen.gen == 0:
            continue
        ups = coord.marks(gen.gen, "up")
        took = max(float(v) for v in ups.values()) - gen.time if len(ups) == coord.nnodes else None
        result.append(Recovery(gen.gen, gen.kind, gen.reason, gen.detected_by, took))
    return result


def print_summary(coord: Coordinator, exit_code: int, job_id: str) -> None:
    rows = recoveries(coord)
    console = Console(stderr=True, highlight=False)
    verdict = "succeeded" if exit_code == 0 else f"failed (exit code {exit_code})"
    console.print(f"ftrun: job {job_id} {verdict}: {len(rows)} failure(s), {len(rows)} restart(s)")
    if not rows:
        return
    table = Table(title="failures and recoveries", title_justify="left")
    table.add_column("gen", justify="right")
    table.add_column("failure")
    table.add_column("cause")
    table.add_column("seen by")
    table.add_column("recovery", justify="right")
    for row in rows:
        took = f"{row.seconds:.2f} s" if row.seconds is not None else "-"
        table.add_row(str(row.gen), row.kind, row.reason, row.detected_by, took)
    console.print(table)
