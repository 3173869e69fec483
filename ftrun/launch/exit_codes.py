"""Exit codes of the ``ftrun`` command (its launcher), what each tells the user or a batch system.

The codes a supervisor returns to its launcher are another set (:mod:`ftrun.control.spec`); the launcher maps
them onto these. 2 (:data:`ftrun.errors.USAGE_EXIT_CODE`) is bad input, nothing started.

* 0: every trainer exited 0.
* :data:`EXIT_FAILED` (3): the training failed for good (restart limit, a crash loop, a node that never joined, no
  room for snapshots): do not requeue it or run it again as is.
* :data:`EXIT_LEFT` (4): this node left a job that goes on: it was seen as lost while it ran (cut off, stalled)
  and a spare took its node rank.
* :data:`EXIT_INTERRUPTED` (130) and :data:`EXIT_PREEMPTED` (143, 128 + SIGTERM; 128 + any other stop signal):
  stopped by a signal after persisting the newest step where there is a ``--ckpt-dir``: requeue to resume.
* :data:`EXIT_UNSAVED` (1): stopped by a signal, but the final persist did not complete; 1 is also any other
  failure that running the job again may cure (this node's supervisor died, under srun a lost node that nothing
  replaces). Any code but 2 and 3: running the job again resumes it from RAM, parity or disk.
"""

from __future__ import annotations

EXIT_UNSAVED = 1
EXIT_FAILED = 3
EXIT_LEFT = 4
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143
