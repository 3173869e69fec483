"""The launcher's first half, before it imports torch: check the input, name the job, start the supervisors.

:func:`begin` does what needs no torch (the script exists, the job fits this host, the job id) and starts
the supervisor processes of this host (:func:`start`), so that their ``import torch`` overlaps the launcher's.
The launcher starts a node's supervisor process (:func:`start`) before it has imported torch itself or opened
the control store. The supervisor imports its modules (about 1.5 s here) meanwhile, then waits on a pipe that
only the two share. Once the launcher knows the node's :class:`~ftrun.control.spec.NodeSpec` (the store's
address, the job's run), it hands it over with the job secret (:meth:`PendingSupervisor.hand`). Neither ever
appears in a process environment, where ``/proc/PID/environ`` would show them to the trainers forked from the
supervisor's zygote; the supervisor's environment carries the job id only (``ftrun clean`` finds a job's
processes by it).

A launcher that stops before handing over (bad input found later, a signal) closes the pipe: the supervisor
reads end-of-file and exits 0 having done nothing (:func:`receive` returns None).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING

from ftrun.control.spec import FORWARDED_SIGNALS, NodeSpec, safe_job_id
from ftrun.errors import UsageError
from ftrun.launch.capacity import local_fit_problem, this_host
from ftrun.launch.env import ENV_JOB_ID
from ftrun.launch.processes import die_with_parent

if TYPE_CHECKING:  # the supervisor imports this module for receive(): not the config's (yaml, ...)
    from ftrun.config import JobConfig

ENV_HANDOFF_FD = "FTRUN_HANDOFF_FD"  # the read end of the pipe the spec comes on
SUPERVISOR_MODULE = "ftrun.launch.supervisor"


@dataclass
class PendingSupervisor:
    """A supervisor process that imports its modules while it waits for its spec."""

    proc: subprocess.Popen[bytes]
    pipe: int | None  # write end; None once handed over or cancelled

    def hand(self, spec: NodeSpec, secret: str) -> subprocess.Popen[bytes]:
        """Give the supervisor its spec and the job secret; returns its process."""
        assert self.pipe is not None, "handed over already"
        data = (json.dumps({"spec": asdict(spec), "secret": secret}) + "\n").encode()
        try:
            with open(self.pipe, "wb", closefd=True) as pipe:
                pipe.write(data)
        except BrokenPipeError:
            pass  # it died while importing: the launcher sees its exit like any supervisor's
        self.pipe = None
        return self.proc

    def cancel(self) -> None:
        """Not needed after all: the supervisor exits 0 without starting anything."""
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None


def start(job_id: str, output: IO[bytes] | None = None) -> PendingSupervisor:
    """Start a supervisor process of ``job_id`` that waits for its spec (stdout and stderr to ``output``, or
    inherited); it dies with this process."""
    read, write = os.pipe()
    env = dict(os.environ)
    env[ENV_JOB_ID] = job_id
    env[ENV_HANDOFF_FD] = str(read)
    launcher = os.getpid()

    def before_exec() -> None:
        die_with_parent(launcher)
        for forwarded in FORWARDED_SIGNALS.values():  # ignored until the supervisor handles them: one that
            signal.signal(forwarded, signal.SIG_IGN)  # comes before is lost, never fatal (as it is by default)

    try:
        proc = subprocess.Popen([sys.executable, "-P", "-m", SUPERVISOR_MODULE], env=env, pass_fds=(read,),
                                stdout=output, stderr=output, start_new_session=True, preexec_fn=before_exec)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return PendingSupervisor(proc, write)


def receive() -> tuple[NodeSpec, str] | None:
    """In the supervisor: its spec and the job secret, once the launcher hands them over (None: it never will)."""
    fd = int(os.environ.pop(ENV_HANDOFF_FD))
    with open(fd, "rb") as pipe:
        line = pipe.readline()
    if not line:
        return None
    doc = json.loads(line)
    return NodeSpec(**doc["spec"]), str(doc["secret"])


@dataclass
class Begun:
    """What the launcher's first half found and started."""

    target: str  # the script's absolute path, the executable's (--no-python), or the module name (-m)
    job_id: str
    pending: list[PendingSupervisor]  # blank supervisors, one per node this host runs (none with --tui)


def begin(cfg: JobConfig, script: str) -> Begun:
    """Check the script and this host, name the job, and start its supervisors here; raises
    :class:`UsageError` (nothing started) on bad input."""
    target = resolve_target(cfg, script)
    if cfg.local_mode and (problem := local_fit_problem(cfg.nnodes, cfg.nproc_per_node, this_host())):
        raise UsageError(problem)
    job_id = job_id_for(cfg)
    count = cfg.nnodes + cfg.spares if cfg.local_mode else 1
    # --tui: each node's output goes to its own file, opened when the node is known
    return Begun(target, job_id, [] if cfg.tui else [start(job_id) for _ in range(count)])


def resolve_target(cfg: JobConfig, target: str) -> str:
    """Check that the script (or executable) exists before anything starts."""
    if cfg.module:
        return target
    if cfg.no_python:
        found = shutil.which(target)
        if found is None:
            raise UsageError(f"executable not found: {target}")
        return found
    if not os.path.isfile(target):
        raise UsageError(f"script not found: {target}")
    return os.path.abspath(target)


def job_id_for(cfg: JobConfig) -> str:
    if cfg.rdzv_id:
        return safe_job_id(cfg.rdzv_id)
    if cfg.local_mode:
        return "job-" + uuid.uuid4().hex[:8]
    return "job-" + hashlib.sha1(str(cfg.rdzv_endpoint).encode()).hexdigest()[:8]
