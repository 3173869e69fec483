"""Rendering of a :class:`~ftrun.ui.status.JobStatus` as rich tables, for ``ftrun status`` and ``ftrun run --tui``.

:func:`render` returns one renderable: a header line, a red line per degraded tier, the nodes and the tiers (side
by side when the width allows), the recent failures, and the ranks last (the one section that grows with the
job, so the one a short terminal crops). Every cell is one line (``no_wrap``; the free-text columns end in an
ellipsis), so a table never wraps into garbage on a narrow terminal: 100 columns show everything.
"""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ftrun.ui.summary import Recovery, spare_lines
from ftrun.ui.status import JobStatus, NodeStatus, RankStatus, Tier

ENDED = ("done", "failed", "stopped")  # job states
FINISHED = ("done", "stopped")  # node states after which a node stops publishing: never shown as lost
MAX_EVENTS = 8
SIDE_BY_SIDE_WIDTH = 96  # below this the nodes and tiers tables are stacked
STATE_STYLES = {"running": "green", "done": "blue", "restarting": "yellow", "rebuilding": "magenta",
                "starting": "dim", "stopped": "yellow", "failed": "bold red", "lost": "bold red"}
BEAT_WARN, BEAT_ALARM = 0.5, 0.8  # share of the hang timeout at which a heartbeat's age turns yellow, red


def render(status: JobStatus, width: int | None = None) -> RenderableType:
    """The whole view of ``status``; ``width`` (the console's) decides whether nodes and tiers sit side by side."""
    nodes, tiers = nodes_table(status), tiers_table(status.tiers)
    if width is None or width >= SIDE_BY_SIDE_WIDTH:
        grid = Table.grid(expand=True, padding=(0, 4, 0, 0))
        grid.add_column(no_wrap=True)
        grid.add_column(ratio=1)
        grid.add_row(nodes, tiers)
        middle: list[RenderableType] = [grid]
    else:
        middle = [nodes, tiers]
    spares = [Text(line, no_wrap=True, overflow="ellipsis") for line in spare_lines(status.spares)]
    return Group(header(status), *alerts(status.tiers), *middle, *spares, events_table(status), ranks_table(status))


def header(status: JobStatus) -> Text:
    """One line: job, state, generation, uptime, restarts, goodput and shape."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("job ", style="bold").append(status.job, style="bold cyan").append("  ")
    text.append(status.state, style=STATE_STYLES.get(status.state, ""))
    goodput = "-" if status.goodput is None else f"{status.goodput:.1%}"
    text.append(f"  gen {status.generation}  up {duration(status.uptime)}  restarts {status.restarts}"
                f"  goodput {goodput}  {status.nnodes} nodes x {status.nproc_per_node}")
    lost = [str(node) for node in status.lost if node_state(status, node) == "lost"]
    if lost:
        text.append(f"  lost node(s): {', '.join(lost)}", style="bold red")
    return text


def alerts(tiers: list[Tier]) -> list[Text]:
    """One red line per degraded tier with its whole reason (its row in the tiers table is too narrow for it)."""
    return [Text(f"{tier.name} tier DEGRADED: {tier.detail}", style="bold red", no_wrap=True, overflow="ellipsis")
            for tier in tiers if tier.degraded]


def node_state(status: JobStatus, node: int) -> str:
    """running | restarting | rebuilding | done | ...: its document's state, "lost" when that is stale, "starting"
    before the first; once the job ended, the job's state (a node's last document may predate its end)."""
    doc = status.nodes.get(node)
    if doc is None:
        return "starting"
    if status.state in ENDED:
        return status.state
    if node in status.lost and doc.state not in FINISHED:
        return "lost"
    return doc.state


def nodes_table(status: JobStatus) -> Table:
    """One row per node: state, generation, incarnation, keeper memory, its EC group's protected step."""
    table = _table("nodes")
    for name, justify in (("node", "right"), ("state", "left"), ("gen", "right"), ("inc", "right"),
                          ("shm", "right"), ("protected", "left")):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    for node in range(status.nnodes):
        state, doc = node_state(status, node), status.nodes.get(node)
        cell = Text(state, style=STATE_STYLES.get(state, ""))
        if doc is None:
            table.add_row(str(node), cell, "-", "-", "-", "-")
        else:
            table.add_row(str(node), cell, str(doc.generation), str(doc.incarnation), size(doc.shm_bytes),
                          protection(status, doc))
    return table


def protection(status: JobStatus, doc: NodeStatus) -> Text:
    """The protected step of the node's EC group ("step 40 (g0)"), or "none"."""
    if doc.group is None:
        return Text("none", style="dim")
    step = status.protected.get(doc.group, 0)
    return Text(f"step {step} (g{doc.group})" if step else f"none (g{doc.group})", style="" if step else "yellow")


def ranks_table(status: JobStatus) -> Table:
    """One row per rank: pid, step, steps/s, heartbeat age vs. its timeout, and its newest snapshot."""
    table = _table("ranks")
    for name in ("rank", "node", "pid", "step", "step/s", "heartbeat", "snap", "age", "size", "GB/s"):
        table.add_column(name, justify="right", no_wrap=True, overflow="ellipsis")
    for node, doc in sorted(status.nodes.items()):
        stale = node_state(status, node) == "lost"
        for rank in doc.ranks:
            table.add_row(str(rank.rank), str(node), _opt(rank.pid), _opt(rank.step), rate(rank.steps_per_s),
                          beat(rank, stale), _opt(rank.snapshot_step), duration(rank.snapshot_age),
                          size(rank.snapshot_bytes) if rank.snapshot_bytes else "-", rate(rank.copy_gbs),
                          style="dim" if stale else None)
    return table


def beat(rank: RankStatus, stale: bool = False) -> Text:
    """Heartbeat age over the hang timeout, green below half of it, yellow below 80 %, red beyond."""
    if rank.beat_age is None:
        return Text("-" if rank.timeout is None else f"-/{duration(rank.timeout)}")
    label = f"{duration(rank.beat_age)}/{duration(rank.timeout)}" if rank.timeout else duration(rank.beat_age)
    if stale or not rank.timeout:
        return Text(label)
    share = rank.beat_age / rank.timeout
    return Text(label, style="green" if share < BEAT_WARN else "yellow" if share < BEAT_ALARM else "bold red")


def tiers_table(tiers: list[Tier]) -> Table:
    """One row per tier (RAM, EC parity, disk): its newest restorable step and age; a degraded one in red (its
    reason is in :func:`alerts`)."""
    table = _table("tiers", expand=True)
    table.add_column("tier", no_wrap=True)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("detail", no_wrap=True, overflow="ellipsis", ratio=1)
    for tier in tiers:
        table.add_row(tier.name, _opt(tier.step), duration(tier.age), "DEGRADED" if tier.degraded else tier.detail,
                      style="bold red" if tier.degraded else None)
    return table


def events_table(status: JobStatus, limit: int = MAX_EVENTS) -> Table:
    """The newest ``limit`` failures: cause and place, who saw it, the step restored and from where, recovery."""
    shown = status.events[-limit:]
    total = len(status.events)
    title = "failures" if len(shown) == total else f"failures (newest {len(shown)} of {total})"
    table = _table(title, expand=True)
    table.add_column("gen", justify="right", no_wrap=True)
    table.add_column("failure", no_wrap=True, overflow="ellipsis", max_width=12)
    table.add_column("cause", no_wrap=True, overflow="ellipsis", ratio=1)
    table.add_column("seen by", no_wrap=True, overflow="ellipsis", max_width=22)
    table.add_column("restored", no_wrap=True, overflow="ellipsis")
    table.add_column("recovery", justify="right", no_wrap=True)
    for event in shown:
        table.add_row(str(event.gen), Text(event.kind, style="red"), cause(event), event.detected_by,
                      restored(event), duration(event.seconds))
    if not shown:
        table.add_row("", Text("none", style="dim"), "", "", "", "")
    return table


def cause(event: Recovery) -> Text:
    """The failure's reason and the step the failed rank had reached (as text: reasons quote error messages,
    which may look like markup: "[/path/pair.cc:537]")."""
    return Text(event.reason + (f" at step {event.failed_step}" if event.failed_step is not None else ""))


def restored(event: Recovery) -> Text:
    """ "step 40 RAM", "none" (started over) or "-" (not agreed: the generation never got that far)."""
    if event.restored is None:
        return Text("-")
    step, source = event.restored
    return Text(f"step {step} {source}") if step else Text("none", style="yellow")


def duration(seconds: float | None) -> str:
    """Compact seconds: 0.42s, 12s, 3m07s, 2h05m; "-" for None."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.2f}s" if seconds < 1 else f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def size(nbytes: int) -> str:
    """Decimal units, as GB/s is: 950B, 1.3MB, 12GB."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            break
        value /= 1000
    else:
        unit = "TB"
    return f"{value:.0f}{unit}" if value >= 100 or unit == "B" else f"{value:.1f}{unit}"


def rate(value: float | None) -> str:
    """Three significant digits at most: 0.09, 9.26, 42.1, 123; "-" for None."""
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _table(title: str, expand: bool = False) -> Table:
    return Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                 expand=expand, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold")
