"""Fencing: a launcher ends its supervisor of a node the job no longer counts on, and leaves a node whose rank a
spare took to that spare.

:class:`Fencing` keeps what the launcher knows of who holds the ranks of the nodes it runs (the spare each was
handed over to, the incarnation each replacement takes over from, since when each runs on though the job lost it)
and decides from the control store:

- :meth:`Fencing.end_lost`: SIGKILL a supervisor that still runs though a spare took its rank (at once) or the
  other nodes declared it lost (``--node-timeout`` later: :func:`fence_verdict`);
- :meth:`Fencing.left_to_spare`: whether a supervisor that died had lost its rank to a spare first (then nothing
  replaces it), and :meth:`Fencing.files_left_to_spare`: whether its files on this host are the spare's now.

Invariant: a supervisor whose rank no spare took and whose loss no node declared is never killed, however slow;
nor is a replacement that has not taken the rank yet.
"""

from __future__ import annotations

import signal
import subprocess
import time

from torch.distributed import DistError

from ftrun.control.coordination import Coordinator
from ftrun.control.ownership import Owner, owner
from ftrun.control.spec import EXIT_REPLACED, shm_place
from ftrun.events import EventLog
from ftrun.launch.processes import ForkedChild, describe_exit


def taken_by_spare(held: Owner | None, handed_to: str | None, replaced: int) -> bool:
    """Whether ``held``, a node's owner, is a spare this launcher did not hand the node over to (``handed_to``,
    :attr:`Fencing.spare_of`): its own supervisors of the node hold the rank as no spare (its first one, its
    replacements) or as the spare handed over, so such an owner took the rank from them. An owner no newer than
    ``replaced``, the one this launcher's replacement of the node takes over from (:attr:`Fencing.replaced`; a
    standby's own spare that took the rank and died since, say), took nothing from that replacement."""
    return held is not None and bool(held.spare) and held.spare != handed_to and held.incarnation > replaced


def fence_verdict(coord: Coordinator, node: int, handed_to: str | None, replaced: int, stalled: dict[int, float],
                  node_timeout: float, now: float) -> tuple[Owner, bool] | None:
    """:meth:`Fencing.end_lost`'s decision for ``node``, whose supervisor here still runs: its owner and whether a
    spare took the rank (:func:`taken_by_spare`) when the supervisor is to be killed, else None. Killed at once
    when a spare took the rank; when the owner was declared lost (``node/<r>/lost`` names its incarnation, newer
    than ``replaced``: see :func:`taken_by_spare`), once ``now`` is more than ``node_timeout`` after the first look
    that saw it so (kept in ``stalled``, by node, until the node is killed or no longer lost). Invariant: a
    supervisor whose rank no spare took and whose loss no node declared is never killed, however slow."""
    held = owner(coord, node)[1]
    taken = taken_by_spare(held, handed_to, replaced)
    declared = (held is not None and not taken and held.incarnation > replaced
                and coord.get("node", node, "lost") == str(held.incarnation).encode())
    if held is None or not (taken or declared):
        stalled.pop(node, None)
        return None
    if declared and now - stalled.setdefault(node, now) <= node_timeout:
        return None
    stalled.pop(node, None)
    return held, taken


class Fencing:
    """A launcher's fencing of the nodes it runs; ``events``: its event log."""

    def __init__(self, events: EventLog, node_timeout: float) -> None:
        self._events = events
        self._node_timeout = node_timeout
        self.spare_of: dict[int, str] = {}  # node -> the spare whose process supervises it now (handed over)
        # node -> the incarnation that held its rank when this launcher started its supervisor's replacement (a
        # lost owner of that incarnation is not the replacement, which has yet to take the rank)
        self.replaced: dict[int, int] = {}
        # node -> since when (time.monotonic()) its supervisor runs on though the job lost it
        self._stalled: dict[int, float] = {}
        # nodes whose files on this host are a spare's now: it took the rank after their killed supervisor stalled
        self._kept_files: set[int] = set()

    def handed_over(self, node: int, spare: str) -> None:
        """``spare``'s process supervises ``node`` now (it took the rank and this launcher waits for it)."""
        self.spare_of[node] = spare

    def replacing(self, node: int, lost: int) -> None:
        """This launcher starts a replacement supervisor of ``node`` that takes the rank from incarnation ``lost``."""
        self.replaced[node] = lost
        self.spare_of.pop(node, None)

    def end_lost(self, coord: Coordinator, procs: dict[int, subprocess.Popen[bytes] | ForkedChild],
                 skip: set[int]) -> dict[int, bool]:
        """SIGKILL this launcher's supervisor in ``procs`` of each node (but ``skip``: killed already) that the job
        no longer counts on while it still runs (stalled: stopped, frozen, cut off): at once when a spare took the
        node's rank (:func:`taken_by_spare`), ``--node-timeout`` after this launcher saw the other nodes declare it
        lost (``node/<r>/lost`` names its incarnation) otherwise. A supervisor never declared lost (slow, however
        slow) is never killed, nor one that rejoined in time (that clears ``node/<r>/lost``), nor a replacement that
        has not taken the rank yet (:attr:`replaced`). Its keeper, zygote and trainers die with it
        (PR_SET_PDEATHSIG, a stopped process too), freeing the node's names on this host (the keeper's socket, its
        files in /dev/shm, the heartbeat table) for a spare here; its exit is a lost supervisor's
        (:meth:`ftrun.launch.launcher.Launcher._wait`): left to the spare, else replaced there, its keeper
        re-adopting the node's snapshots (under srun, the step having ended, the end of this node's part, its
        snapshots kept for the next step). Waited on, it held up the job until ``--rdzv-timeout`` (under srun its
        step for ever). Returns the nodes killed, each with whether a spare had taken its rank."""
        now = time.monotonic()
        killed: dict[int, bool] = {}
        for node, proc in procs.items():
            if node in skip or proc.poll() is not None:
                self._stalled.pop(node, None)
                continue
            try:
                verdict = fence_verdict(coord, node, self.spare_of.get(node), self.replaced.get(node, 0),
                                        self._stalled, self._node_timeout, now)
            except DistError:  # the control store is away: nothing to tell (the supervisor waits for it too)
                continue
            if verdict is None:
                continue
            held, taken = verdict
            proc.send_signal(signal.SIGKILL)
            killed[node] = taken
            if taken:
                self._events.emit("fenced", f"node {node}'s supervisor (pid {proc.pid}) still ran after spare "
                                  f"{held.spare} took its rank: killed, with its keeper and trainers", node=node,
                                  spare=held.spare, pid=proc.pid)
            else:
                self._events.emit("stalled", f"node {node}'s supervisor (pid {proc.pid}) still ran "
                                  f"{self._node_timeout:g}s after the job lost it (stalled: stopped, frozen?): "
                                  "killed, with its keeper and trainers", node=node, pid=proc.pid)
        return killed

    def left_to_spare(self, node: int, held: Owner | None, code: int) -> bool:
        """Multi-node: whether a spare took ``node``'s rank (``held``: its owner, just read) from its supervisor,
        which died (``code``) before it saw that (stalled until then, say). The launcher then leaves the job to that
        spare as a supervisor that sees it does (:data:`EXIT_REPLACED`): no node-lost generation, no replacement (it
        would take the rank from the running spare), and the node's files stay where the spare shares this host's
        shared memory (same names)."""
        if not taken_by_spare(held, self.spare_of.get(node), self.replaced.get(node, 0)):
            return False
        assert held is not None
        if held.shm and held.shm == shm_place():
            self._kept_files.add(node)
        self._events.emit("replaced", f"leaving the job: node rank {node} was taken by spare {held.spare} "
                          f"(incarnation {held.incarnation}) before its supervisor here was {describe_exit(code)}",
                          node=node, spare=held.spare, exit_code=code)
        return True

    def files_left_to_spare(self, node: int, proc: subprocess.Popen[bytes] | ForkedChild | None) -> bool:
        """Whether ``node``'s files on this host are not this launcher's to remove at its end: its supervisor
        ``proc`` left the job to a spare (:data:`EXIT_REPLACED`; it removed them itself unless the spare shares
        them), or died after a spare that shares them took the rank."""
        return (proc is not None and proc.poll() == EXIT_REPLACED) or node in self._kept_files
