"""``ftrun sbatch-template``: a SLURM batch script that runs ftrun in job steps, with spare nodes, until the
training finished or failed for good.

The allocation has ``nodes + spares`` nodes and is not killed when one of them fails (``--no-kill``). Each
attempt is one ``srun`` step of ftrun on ``nodes`` of them. A lost node ends the step (SLURM kills it on every
node) but not the allocation: the next attempt runs on the nodes left, where the surviving nodes resume from
their RAM and a spare, taking the lost node's rank, rebuilds its snapshots from its peers' parity
(:mod:`ftrun.launch.slurm`). ftrun's exit code decides what happens next (see :data:`EXIT_MEANING`).

``--no-resume`` (:data:`FIRST_RUN_FLAGS`) is given to the first attempt only, and not after a requeue
(``SLURM_RESTART_COUNT`` > 0): a retried or requeued step must resume the job's own checkpoint, not move it aside.
"""

from __future__ import annotations

import shlex
import sys

from ftrun.errors import USAGE_EXIT_CODE, UsageError
from ftrun.launch.config import MAX_COUNT, MAX_NNODES
from ftrun.launch.exit_codes import EXIT_FAILED, EXIT_PREEMPTED

TERM_WARNING = 180  # seconds before the time limit at which SLURM sends the steps SIGTERM (--signal)
FIRST_RUN_FLAGS = ("--no-resume",)  # ftrun flags for the first attempt of the job's first run only
EXIT_MEANING = {
    0: "the training finished",
    USAGE_EXIT_CODE: "bad command or input: do not run it again",
    EXIT_FAILED: "the training failed for good (restart limit, fatal error): do not requeue",
    EXIT_PREEMPTED: "stopped by SIGTERM (preemption, time limit) after persisting: requeue to resume from disk",
}

_TEMPLATE = """\
#!/bin/bash
# ftrun batch script (`ftrun sbatch-template`): {nodes} training node(s) and {spares} spare(s).
# Each attempt is one srun step of ftrun on {nodes} node(s). A lost node ends the step but not the job
# (--no-kill): the next attempt runs on the nodes left, the survivors resuming from their RAM and a spare
# rebuilding the lost node's snapshots from its peers' parity.
# Exit codes of this script (ftrun's):
{meanings}
# SIGTERM to the steps (--signal below, `scancel --signal=TERM JOB`, preemption) makes ftrun persist the
# newest step to its --ckpt-dir and exit 143. To requeue then, set RequeueExit=143 in slurm.conf (or run
# `scontrol requeue JOB`): a requeued job keeps its job id, so ftrun resumes from disk. Give KillWait (or the
# partition's GraceTime) more seconds than --persist-grace. (srun itself kills its step on SIGTERM, so a
# signal to this script, `scancel --full`, ends the step without the final persist.)
#SBATCH --job-name=ftrun
#SBATCH --nodes={total}
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill
#SBATCH --signal=TERM@{warning}

FTRUN=({command})
ATTEMPTS={attempts}
{first_run}
stopping=
trap 'stopping=1' TERM
for attempt in $(seq 1 "$ATTEMPTS"); do
    echo "ftrun-batch: attempt $attempt of $ATTEMPTS on {nodes} node(s)"
    srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 {words} &
    step=$!{forget}
    wait "$step"; rc=$?
    while kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done  # a trapped signal interrupted wait
    case $rc in
        0) echo "ftrun-batch: the training finished"; exit 0 ;;
        {usage}|{failed}) echo "ftrun-batch: ftrun exited $rc: failed for good, not running it again"
            exit {failed} ;;
        {preempted}) echo "ftrun-batch: stopped after persisting (exit {preempted}): requeue to resume"
            exit {preempted} ;;
    esac
    if [ -n "$stopping" ]; then echo "ftrun-batch: this script got SIGTERM (ftrun exited $rc)"; exit {preempted}; fi
    echo "ftrun-batch: the step ended with exit $rc (a node lost?): running ftrun again on the nodes left"
done
echo "ftrun-batch: giving up after $ATTEMPTS attempts"
exit {failed}
"""


_FIRST_RUN = """\
# {flags}: on the first attempt only, and not once SLURM requeued the job: a retry or a requeue resumes
FIRST=({flags})
if [ "${{SLURM_RESTART_COUNT:-0}}" != 0 ]; then FIRST=(); fi
"""


def render(nodes: int, spares: int, attempts: int, ftrun_args: list[str], ftrun: list[str] | None = None,
           script_at: int | None = None) -> str:
    """The batch script for ``ftrun [ftrun_args]`` on ``nodes`` nodes plus ``spares`` spares. ``script_at``: the
    index in ``ftrun_args`` where the script and its arguments start (None: unknown, no flag is first-run only)."""
    if not (1 <= nodes <= MAX_NNODES and 0 <= spares <= MAX_NNODES and 1 <= attempts <= MAX_COUNT):
        raise UsageError(f"--nodes must be at least 1 and at most {MAX_NNODES} (ftrun's --nnodes), --spares at least 0 "
                         f"and at most {MAX_NNODES}, --attempts at least 1 and at most {MAX_COUNT}; got {nodes}, "
                         f"{spares} and {attempts}")
    if not ftrun_args:
        raise UsageError("give the ftrun arguments after --, for example: -- --nproc-per-node 8 train.py")
    flags, script = (ftrun_args, []) if script_at is None else (ftrun_args[:script_at], ftrun_args[script_at:])
    first = [flag for flag in flags if flag in FIRST_RUN_FLAGS] if script_at is not None else []
    prefix = [*(ftrun or [sys.executable, "-m", "ftrun"]), *(flag for flag in flags if flag not in first)]
    words, first_run, forget = '"${FTRUN[@]}"', "", ""
    if first:
        at = len(prefix)
        words = f'"${{FTRUN[@]:0:{at}}}" "${{FIRST[@]}}" "${{FTRUN[@]:{at}}}"'
        first_run, forget = _FIRST_RUN.format(flags=shlex.join(first)), "; FIRST=()"
    meanings = "\n".join(f"#   {code}: {meaning}" for code, meaning in EXIT_MEANING.items())
    return _TEMPLATE.format(nodes=nodes, spares=spares, total=nodes + spares, attempts=attempts,
                            command=shlex.join([*prefix, *script]), meanings=meanings, usage=USAGE_EXIT_CODE,
                            failed=EXIT_FAILED, preempted=EXIT_PREEMPTED, warning=TERM_WARNING, words=words,
                            first_run=first_run, forget=forget)
