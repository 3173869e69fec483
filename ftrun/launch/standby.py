"""A standby launcher's steps (``--standby``, or a launcher that found every node rank taken): it joins the job's
current (or next) run as a hot spare (:func:`join_run`, :func:`standby_spec`), starts another spare when its
spare dies while it waits (:func:`spare_died`), and once its spare took a lost node's rank (:func:`node_taken`)
is that node's launcher; :func:`spare_exit` is its exit code when its spare ran no node to the end.

Invariants: a standby joins only a run that is running (no ``state`` yet) with the same trainers per node and
the same script, by content; it runs with the job's settings (its document), not its own command line's.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import replace
from typing import Any

from torch.distributed import DistError

from ftrun.control.coordination import Coordinator, current_run
from ftrun.control.ownership import owner, retire_spare, spares
from ftrun.control.signed import SignedStore
from ftrun.control.spec import (EXIT_DONE, EXIT_JOB_FAILED, EXIT_REPLACED, EXIT_STOPPED, EXIT_STOPPED_UNSAVED,
                                NodeSpec)
from ftrun.errors import UsageError
from ftrun.events import EventLog
from ftrun.launch.config import JobConfig
from ftrun.launch.exit_codes import EXIT_FAILED, EXIT_LEFT, EXIT_UNSAVED
from ftrun.launch.node_spec import script_digest
from ftrun.launch.processes import RESTART_WINDOW, RestartLimit, describe_exit
from ftrun.snapshot.reserve import SlotReserve


def join_run(store: SignedStore, job_id: str, endpoint: str, cfg: JobConfig, target: str,
             flag: str) -> tuple[int, dict[str, Any]]:
    """The job's running run and its document, waited for up to ``--rdzv-timeout``; a UsageError (``flag``
    names the standby) when none runs by then, or when it runs other than ``--nproc-per-node`` trainers per node
    or another script than ``target`` (by content: :func:`script_digest`)."""
    deadline = time.monotonic() + cfg.rdzv_timeout
    while True:
        run = current_run(store, job_id)
        doc = Coordinator(store, job_id, -1, 1, run=run).job_doc() if run else None
        if doc is not None and store.get(f"ftrun/{job_id}/{run}/state") is None:
            break
        if time.monotonic() > deadline:
            raise UsageError(f"{flag}: no running job {job_id} at {endpoint} within {cfg.rdzv_timeout:g}s")
        time.sleep(0.1)
    assert run is not None
    if int(doc["nproc_per_node"]) != cfg.nproc_per_node:
        raise UsageError(f"{flag}: the job runs {doc['nproc_per_node']} trainer(s) per node, this spare "
                         f"--nproc-per-node {cfg.nproc_per_node}; not joining")
    if doc.get("script") != script_digest(cfg, target):
        raise UsageError(f"{flag}: {target} is not the job's script ({doc.get('target')}: contents differ); not "
                         "joining")
    return run, doc


def standby_spec(base: NodeSpec, doc: dict[str, Any], name: str) -> NodeSpec:
    """The spec of the standby's spare ``name``: ``base`` (its own, of no node) with the job's settings (``doc``)."""
    group, parity, backend = doc["ec"]
    every, keep, ckpt_format = doc["persist"]
    return replace(base, nnodes=int(doc["nnodes"]), args=list(doc["args"]), ec_group=int(group),
                   ec_parity=int(parity), ec_backend=str(backend), persist_every=int(every), keep=int(keep),
                   ckpt_format=str(ckpt_format), ckpt_dir=doc["ckpt_dir"], spare=name)


def spare_died(coord: Coordinator, name: str, pid: int, code: int, exits: RestartLimit, nproc_per_node: int,
               events: EventLog) -> bool:
    """A standby's spare (process ``pid``) died (``code``) before it took a rank: the OOM killer, a crash. Its
    record says "gone" from now on and its reserve is unlinked. True when it had been waiting and its spares
    did not die too often (``exits``, :class:`RestartLimit`): then the standby starts another, as ``--spares``
    does; False when it died before it enlisted (it would again), or too often."""
    SlotReserve(coord.job_id, name, nproc_per_node).release()
    try:
        waited = retire_spare(coord, name, pid)
    except DistError:  # the control store is gone, and the job with it
        waited = False
    again = waited and not exits.reached()
    then = ("starting another" if again else "it never enlisted: this standby ends" if not waited
            else f"its spares died {len(exits)} times within {RESTART_WINDOW:g}s: this standby ends")
    events.emit("spare_gone", f"spare {name} (pid {pid}) {describe_exit(code)} while it waited for a lost node; "
                f"{then}", spare=name, exit_code=code, restarted=again)
    return again


def spare_exit(code: int, signalled: int | None) -> int:
    """The exit code of a standby whose supervisor exited with ``code`` (it ran no node, or it ended its node's
    part of the job); ``signalled``: the stop signal the standby got, if any."""
    if code == EXIT_DONE:
        return 0
    if code in (EXIT_STOPPED, EXIT_STOPPED_UNSAVED) or signalled is not None:
        return EXIT_UNSAVED if code == EXIT_STOPPED_UNSAVED else 128 + (signalled or signal.SIGTERM)
    return EXIT_FAILED if code == EXIT_JOB_FAILED else EXIT_LEFT if code == EXIT_REPLACED else 1


def node_taken(coord: Coordinator, spare: str) -> int | None:
    """The node rank that ``spare`` took, as the spares' registry says (it stays so after another spare took the
    rank from it); None when it took none, or the control store is gone."""
    try:
        docs = spares(coord)
    except DistError:
        return None
    return next((doc.node for doc in docs if doc.name == spare and doc.state == "took"), None)


def holds_node_0(coord: Coordinator, spare: str) -> bool:
    """Whether ``spare`` holds node rank 0 (then its standby holds the job's checkpoint directory for the run);
    False when the control store is gone."""
    with contextlib.suppress(DistError):
        return getattr(owner(coord, 0)[1], "spare", None) == spare
    return False


def spare_rank(coord: Coordinator, spare: str) -> int:
    """The node whose rank ``spare`` took and held to the end, else -1."""
    rank = -1
    for node in range(coord.nnodes):
        held = owner(coord, node)[1]
        if held is not None and held.spare == spare:
            rank = node
    return rank
