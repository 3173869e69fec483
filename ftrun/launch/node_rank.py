"""How a launcher comes to its node rank when the command line gives none, and holds it on this host.

- torchrun's multi-node form without ``--node-rank`` (:attr:`JobConfig.rank_by_store`): the lowest rank of the
  run no launcher took yet, by compare-and-set in the control store (:func:`agree_rank`);
- under srun: the rank whose snapshots this node holds from an earlier step, or a free one (:func:`agree_slurm_rank`);
- on this host: a claim on the job's nodes, held for the launcher's life (:func:`hold_claim`), so a second launcher of
  the job for the same node fails before it touches the job's files.

Invariant: each agreement says in one event line which rank it agreed and why.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

from ftrun.control.coordination import Coordinator
from ftrun.control.ownership import claim_free_rank
from ftrun.control.signed import SignedStore
from ftrun.errors import UsageError
from ftrun.events import EventLog
from ftrun.launch.clean import claim_nodes
from ftrun.launch.slurm import SlurmStep, agree_node_rank, read_claim


def agree_rank(store: SignedStore, job_id: str, nnodes: int, run: int, events: EventLog) -> int | None:
    """torchrun's multi-node form without --node-rank: take the lowest node rank of run ``run`` no launcher took
    yet; None when every rank is taken (this launcher is then a spare)."""
    me = f"{socket.gethostname()}-{os.getpid()}"
    taken = claim_free_rank(Coordinator(store, job_id, -1, nnodes, run=run), me, socket.gethostname())
    if taken is None:
        return None
    events.emit("node_rank", f"node rank {taken} agreed through the control store (run {run}: first come, first "
                "served; no --node-rank given)", node_rank=taken, run=run)
    return taken


def agree_slurm_rank(store: SignedStore, job_id: str, step: SlurmStep, rdzv_timeout: float, events: EventLog) -> int:
    """Under srun: take the node rank whose snapshots this node holds from an earlier step, or a free one."""
    claim = read_claim(job_id, step.node_name)
    node_rank = agree_node_rank(store, job_id, step, claim, rdzv_timeout)
    why = ("kept: its snapshots from an earlier step are in this node's RAM" if claim == node_rank
           else "new to this job: earlier snapshots of its ranks, if any, come from parity or disk"
           if claim is None else f"its rank {claim} went to another node")
    events.emit("slurm_step", f"SLURM step {step.job_id}.{step.step_id} on {step.node_name}: node rank "
                f"{node_rank} ({why})", slurm_node=step.node_name, node_rank=node_rank, claimed=claim,
                slurm_step=f"{step.job_id}.{step.step_id}")
    return node_rank


def hold_claim(job_id: str, nodes: Iterable[int]) -> list[socket.socket]:
    """This host's claim on the job's ``nodes``, held while the returned sockets are open (:func:`claim_nodes`);
    a UsageError when another launcher of the job holds one."""
    claims, problem = claim_nodes(job_id, nodes)
    if problem:
        raise UsageError(f"{problem}: stop it first, or choose another --rdzv-id")
    return claims
