"""The shape of a job's EC groups and the pyeclib backends, checked by the command line before anything starts.

Kept apart from :mod:`ftrun.snapshot.erasure` (numpy, pyeclib, ISA-L) so that ``ftrun``'s first process, which
checks the flags and then becomes the launcher, imports none of them: that was 0.12 s of CPU before every job.
"""

from __future__ import annotations

DEFAULT_BACKEND = "isa_l_rs_vand"
BACKENDS = ("isa_l_rs_vand", "isa_l_rs_cauchy", "liberasurecode_rs_vand")
MAX_DEFAULT_GROUP = 4


def default_group(nnodes: int) -> tuple[int, int]:
    """(G, m) when the user gave neither: no redundancy on one node, else m = 1 in groups of up to 4 nodes.

    G is the largest divisor of ``nnodes`` in 2..4; a prime node count above 4 forms one group of all nodes.
    """
    if nnodes < 2:
        return 1, 0
    group = max((g for g in range(2, MAX_DEFAULT_GROUP + 1) if nnodes % g == 0), default=nnodes)
    return group, 1


def group_problem(nnodes: int, group: int, parity: int, backend: str) -> str | None:
    """Why (G, m, backend) cannot protect ``nnodes`` nodes, in one line; None when it can."""
    if group < 1 or parity < 0:
        return f"--ec-group must be >= 1 and --ec-parity >= 0, got {group} and {parity}"
    if parity == 0:
        return None
    if parity >= group:
        return f"--ec-parity {parity} must be smaller than --ec-group {group} (at least one data node per group)"
    if group > nnodes:
        return f"--ec-group {group} is larger than --nnodes {nnodes}"
    if nnodes % group:
        return f"--nnodes {nnodes} cannot be divided into groups of --ec-group {group}"
    if backend not in BACKENDS:
        return f"--ec-backend {backend!r} is not available (available: {', '.join(BACKENDS)})"
    return None
