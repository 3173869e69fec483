"""How a supervisor's run ends early: the exceptions that carry the end to :meth:`Supervisor.run
<ftrun.launch.supervisor.Supervisor.run>`, which turns each into its exit code (:mod:`ftrun.control.spec`).

They live apart from the supervisor so that its collaborators (:mod:`ftrun.launch.keeper_process`) can raise them
without importing it.
"""

from __future__ import annotations


class JobFailed(Exception):
    """The job cannot go on (restart limit, a node that never joined, the control store gone)."""


class Replaced(Exception):
    """This node was seen as lost and another supervisor (a spare) owns its node rank now."""


class StepEnded(Exception):
    """Under srun, the step cannot go on (:data:`~ftrun.control.spec.STEP_END_KIND`); the node's snapshots stay in
    RAM for the job's next step, as they do when node 0's ftrun, and the c10d control store with it, is gone (a
    ``DistError``)."""
