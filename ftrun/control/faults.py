"""Fault injection: ``--inject KIND@key=value,...`` specs, for tests, examples and recovery rehearsals.

Kinds and their required keys:

- ``crash@rank=R,step=S``: trainer R kills itself with SIGKILL at its first heartbeat with step >= S.
- ``hang@rank=R,step=S``: trainer R stops itself with SIGSTOP there (a hang the supervisor must detect).
- ``copy-crash@rank=R,step=S``: trainer R kills itself with SIGKILL halfway through copying the snapshot of
  its first snapshot step >= S (the slot is left half written).
- ``commit-crash@rank=R,step=S``: the same, after the copy and before the slot is committed (other ranks
  commit that step, this one does not).
- ``keeper-crash@node=N,step=S``: the keeper of node N kills itself with SIGKILL when a trainer commits a
  snapshot of step >= S (fires in one keeper incarnation only).
- ``node-loss@node=N,step=S``: the supervisor of node N kills every process of the node, itself included,
  once one of its trainers reports step >= S.
- ``parity-loss@node=N,step=S``: node N is lost the same way while its keeper computes the erasure-coded
  parity of a step >= S (after its first parity stripe, before the commit), so that step never becomes
  protected.
- ``serve-loss@node=N,step=S``: node N is lost the same way when its keeper is asked for a piece of a step
  >= S by a peer rebuilding a lost node (a survivor lost during a rebuild; use ``gen=1`` after a node-loss).
- ``serve-stall@node=N,step=S``: node N's keeper stops itself (SIGSTOP) there instead: a survivor frozen during
  a rebuild, whose node lives on (its supervisor's keeper watch kills and restarts it).

Every fault also takes ``gen=G`` (default 0) and fires at most once: only in generation G. Trainer faults
travel to the trainer in :data:`ENV_TRAINER_FAULTS` as ``kind:step`` pairs and fire inside
``ftrun.heartbeat`` (crash, hang; :mod:`ftrun.control.heartbeat`) or in the Snapshotter (copy-crash,
commit-crash; :mod:`ftrun.snapshot.client`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.errors import UsageError, natural

ENV_TRAINER_FAULTS = "FTRUN_INJECT"

TRAINER_FAULTS = ("crash", "hang", "copy-crash", "commit-crash")
_WHERE = {"crash": "rank", "hang": "rank", "copy-crash": "rank", "commit-crash": "rank", "keeper-crash": "node",
          "node-loss": "node", "parity-loss": "node", "serve-loss": "node", "serve-stall": "node"}


@dataclass(frozen=True)
class Fault:
    """One injected failure: ``kind`` at ``step`` of rank ``where`` (or node, for node faults) in ``gen``."""

    kind: str
    where: int
    step: int
    gen: int = 0

    @property
    def spec(self) -> str:
        return f"{self.kind}@{_WHERE[self.kind]}={self.where},step={self.step},gen={self.gen}"


def parse_fault(spec: str) -> Fault:
    """Parse one ``--inject`` spec; a malformed one raises :class:`UsageError` saying which part is wrong."""
    kind, sep, rest = spec.partition("@")
    kind = kind.strip()
    if kind not in _WHERE:
        raise UsageError(f"--inject {spec!r}: unknown fault kind {kind!r} (known: {', '.join(_WHERE)})")
    if not sep or not rest:
        raise UsageError(f"--inject {spec!r}: expected {kind}@{_WHERE[kind]}=N,step=S")
    values: dict[str, int] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq:
            raise UsageError(f"--inject {spec!r}: {part!r} is not key=value")
        if key not in (_WHERE[kind], "step", "gen"):
            raise UsageError(f"--inject {spec!r}: unknown key {key!r} for {kind}")
        number = natural(value.strip())
        if number is None:
            raise UsageError(f"--inject {spec!r}: {key} must be a non-negative integer, got {value!r}")
        if key in values:
            raise UsageError(f"--inject {spec!r}: {key} is given twice")
        values[key] = number
    for key in (_WHERE[kind], "step"):
        if key not in values:
            raise UsageError(f"--inject {spec!r}: missing {key}=")
    return Fault(kind, values[_WHERE[kind]], values["step"], values.get("gen", 0))


def parse_faults(specs: list[str], nnodes: int | None = None, nproc_per_node: int | None = None) -> list[Fault]:
    """Parse ``--inject`` specs; with the job's shape, a rank or node it does not have is a :class:`UsageError`
    (such a fault would never fire)."""
    faults = [parse_fault(spec) for spec in specs]
    for fault, spec in zip(faults, specs):
        node_fault = _WHERE[fault.kind] == "node"
        limit = nnodes if node_fault else None if nnodes is None or nproc_per_node is None else nnodes * nproc_per_node
        if limit is not None and fault.where >= limit:
            raise UsageError(f"--inject {spec!r}: the job has {limit} {'node' if node_fault else 'rank'}(s), "
                             f"numbered from 0")
    return faults


def trainer_faults_env(faults: list[Fault], rank: int, gen: int) -> str:
    """The :data:`ENV_TRAINER_FAULTS` value for global ``rank`` in generation ``gen`` ('' when none)."""
    return ",".join(f"{f.kind}:{f.step}" for f in faults
                    if f.kind in TRAINER_FAULTS and f.where == rank and f.gen == gen)


def decode_trainer_faults(value: str) -> list[tuple[str, int]]:
    pairs = []
    for item in filter(None, value.split(",")):
        kind, _, step = item.partition(":")
        pairs.append((kind, int(step)))
    return pairs
