"""The launcher: the ``ftrun`` process a user starts. It owns the control store and the supervisors.

- Local mode (no ``--node-rank``): hosts the control store and starts one supervisor per simulated node. A
  supervisor that dies by a signal or crashes is a lost node: a replacement takes the same node rank.
- Multi-node mode (``--node-rank`` and ``--rdzv-endpoint``): starts this node's supervisor, and a replacement
  when it dies while this launcher lives (unless a hot spare claims the rank first), or stalls: it kills one
  that still runs ``--node-timeout`` after the job declared it lost (:mod:`ftrun.launch.fencing`, in every
  mode); node 0 hosts the control store (:mod:`ftrun.launch.store_host`) unless one already runs at the
  endpoint (``ftrun store``). Under ``srun`` the first node of the step hosts it, and the nodes agree their node
  ranks first (:mod:`ftrun.launch.node_rank`), so a node keeps the rank whose snapshots it holds from an earlier
  step of the job. A launcher that starts a replacement says so in the control store (``node/<r>/replacing``):
  under srun the other nodes wait only for such a replacement or a spare, and otherwise end the step, keeping
  their snapshots and claim files for the next.
- torchrun's multi-node form, ``--rdzv-endpoint`` and ``--nnodes`` > 1 without ``--node-rank`` (:attr:`JobConfig.
  rank_by_store`): every launcher on the endpoint's host tries to host the store (the first to bind the port
  does, the others join), then each takes the lowest free node rank of the run by compare-and-set
  (:func:`ftrun.control.ownership.claim_free_rank`) before its supervisor gets its spec; one that finds every
  rank taken joins as a hot spare, as ``--standby`` does.
- A standby (``--standby``): starts a hot spare (:mod:`ftrun.launch.standby`); once the spare took a lost node's
  rank, the launcher is that node's and replaces its supervisor as above.

It forwards SIGINT/SIGTERM to the supervisors as a graceful stop, prints the job summary, and, as a child
subreaper, kills whatever descendant is left before it exits. Its other concerns are its collaborators': the
supervisors' specs and the job's document (:mod:`ftrun.launch.node_spec`), the job's ``--ckpt-dir`` checks and
hold (:mod:`ftrun.launch.job_dir`) and how it leaves a multi-node job (:mod:`ftrun.launch.leaving`);
:class:`Launcher` coordinates them.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from rich.console import Console
from torch.distributed import DistError, TCPStore

from ftrun.launch.config import JobConfig
from ftrun.errors import USAGE_EXIT_CODE, UsageError, error_line
from ftrun.events import EventLog
from ftrun.control.backend import StoreAddress
from ftrun.control.coordination import Coordinator, Failure, Generation, open_run, signed, use_job
from ftrun.control.ownership import owner
from ftrun.control.signed import SignedStore
from ftrun.launch.fencing import Fencing
from ftrun.launch.handoff import STARTUP_SIGNALS, Begun, PendingSupervisor, prepare_supervisor, resume, start
from ftrun.launch.env import trainer_threads
from ftrun.launch.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LEFT, EXIT_UNSAVED
from ftrun.launch.job_dir import hold_job_dir, move_steps_aside, take_job_dir
from ftrun.launch.leaving import host_until_the_run_ends, leave
from ftrun.launch.node_spec import job_doc, node_spec, omp_threads
from ftrun.launch.node_rank import agree_rank, agree_slurm_rank, hold_claim
from ftrun.launch.processes import (LAUNCHER_NAME, ExitWatch, ForkedChild, RestartLimit, become_subreaper,
                                    describe_exit, kill_descendants, left_by_user, reap_orphans, set_process_name)
from ftrun.launch.standby import holds_node_0, join_run, node_taken, spare_died, spare_exit, spare_rank, standby_spec
from ftrun.launch.store_host import bind_address, open_control_store, store_hint
from ftrun.launch.supervisor import main as supervisor_main
from ftrun.launch.zygote import preload, size_blas
from ftrun.control.secret import local_secret, secret_path, shared_secret, write_secret_file
from ftrun.launch.spare_pool import SparePool
from ftrun.launch.slurm import SlurmStep, claim_path, slurm_step
from ftrun.control.spec import (EXIT_DONE, EXIT_JOB_FAILED, EXIT_REPLACED, EXIT_STEP_ENDED, EXIT_STOPPED,
                                EXIT_STOPPED_UNSAVED, FORWARDED_SIGNALS, NodeSpec, STEP_END_KIND, STOP_KIND,
                                announce_path, nodes_with_files, unlink_node_files, write_shm_file)
from ftrun.ui.summary import Recovery, print_summary
from ftrun.snapshot.dir_owner import DirOwner
from ftrun.snapshot.persist import job_dir
from ftrun.snapshot.reserve import unlink_reserves
from ftrun.ui.live import POLL_INTERVAL as LIVE_POLL_INTERVAL, WATCHED, LiveView
from ftrun.ui.status import PUBLISH_INTERVAL, gather

# A second stop signal within this many seconds of the first is the same stop delivered twice (a signal to the
# process group that a wrapper such as `timeout` relays too); a later one stops the job at once (no final persist)
REPEAT_GAP = 1.0
END_STORE_TIMEOUT = 5.0  # seconds a failed job's summary waits for a store operation (a frozen store host)
_POLL_INTERVAL = 0.02
# seconds between two looks of a launcher whose supervisors' exits wake it (pidfds) and that has nothing else to
# look after (no spares, no vacant node rank, no --tui view)
IDLE_LOOK = 1.0
FENCE_INTERVAL = 0.1  # seconds between two looks of a launcher with --spares at the nodes it runs (Fencing.end_lost)
# a supervisor's exit codes that end its node's part of the job; any other is a lost supervisor (killed, crashed)
SUPERVISOR_ENDS = (EXIT_DONE, EXIT_JOB_FAILED, EXIT_STOPPED, EXIT_STOPPED_UNSAVED, EXIT_REPLACED, EXIT_STEP_ENDED)


def announce_job(job_id: str, endpoint: str, nnodes: int, backend: str) -> str:
    """Write ``<shm dir>/ftrun-<job>-launcher`` (JSON: job, endpoint, backend, nnodes, pid; mode 0600) so that
    ``ftrun status`` on this host finds the job's control store; the launcher removes it when it exits."""
    path = announce_path(job_id)
    write_shm_file(path, json.dumps({"job": job_id, "endpoint": endpoint, "backend": backend, "nnodes": nnodes,
                                     "pid": os.getpid()}))
    return path


def _stop_signal(coord: Coordinator) -> int:
    """The signal that stopped the job, as its generation of kind "stop" names it (SIGTERM when unknown)."""
    try:
        gen = coord.current()
        return signal.Signals[gen.detected_by] if gen.kind == STOP_KIND else signal.SIGTERM
    except (KeyError, DistError):
        return signal.SIGTERM


class Launcher:
    """One ``ftrun`` process's part of a job (see the module docstring): :meth:`run` runs it to its end."""

    def __init__(self, cfg: JobConfig, begun: Begun, args: list[str], pending: list[PendingSupervisor]) -> None:
        self.cfg = cfg
        self.target = begun.target
        self.args = args
        self.job_id = begun.job_id
        self.no_zygote_because = begun.no_zygote_because
        self.pending = pending  # supervisors forked by main(), waiting for a spec
        self.node_rank = cfg.node_rank or 0  # under srun: agreed with the other nodes once the store is up
        step = None if cfg.local_mode else slurm_step(os.environ)
        self.slurm: SlurmStep | None = (step if step is not None and not cfg.local_mode and cfg.nnodes == step.nnodes
                                        and cfg.node_rank == step.node_id else None)
        made_log_dir = cfg.log_dir is None and cfg.output.writes_files
        if made_log_dir:  # --redirects/--tee without --log-dir: a kept temporary directory, as torchrun
            cfg.log_dir = tempfile.mkdtemp(prefix="ftrun-logs-")
        # --tui: the live view replaces the event lines; every node's output goes to a file instead
        self.output_dir = (cfg.log_dir or tempfile.mkdtemp(prefix="ftrun-output-")) if cfg.tui else None
        self.events = EventLog("launcher", cfg.log_dir, stream=None if cfg.tui else sys.stderr)
        if made_log_dir:
            self.events.emit("log_dir", f"trainer output files (--redirects/--tee) in {cfg.log_dir}: no --log-dir "
                             "given", path=cfg.log_dir)
        self.view: LiveView | None = None
        self._settled: dict[int, Recovery] = {}  # the --tui view's recoveries read before (ftrun.ui.summary)
        self._next_view = 0.0
        self.store_server: TCPStore | None = None
        self.address: StoreAddress | None = None  # where the control store is (set by run())
        self.procs: dict[int, subprocess.Popen[bytes] | ForkedChild] = {}
        self.pool: SparePool | None = None  # --spares
        self._exits = ExitWatch()  # see _pause
        self.fencing = Fencing(self.events, cfg.node_timeout)  # who holds the ranks of the nodes it runs
        # under srun the nodes whose supervisor it ended after their step had ended (their snapshots stay for the
        # next step, as that one's)
        self._step_over: set[int] = set()
        self.signalled: int | None = None
        self.files: list[str] = []  # what this launcher wrote in the shm dir (removed by remove_files())
        self.claims: list[socket.socket] = []  # this host's claim on the job's nodes, held for life (hold_claim)
        self.signalled_at = 0.0  # time.monotonic() of the signal that began the stop
        self.forced = False  # a second signal stopped the job at once
        self.ignored: list[signal.Signals] = []  # SIGUSR1/SIGUSR2 not in --signals-to-handle, not reported yet
        # signs every control-store value (and authenticates keepers to each other); never given to trainers
        self.secret = local_secret() if cfg.local_mode else shared_secret(self.job_id, cfg.secret_file)
        self.bind = bind_address(cfg)
        self.job_run = 0  # the job's run in the control store (taken or joined in run())
        self.dir_owner: DirOwner | None = None  # node 0's hold on the job's --ckpt-dir directory
        self.job_spec: NodeSpec | None = None  # a standby's: the job's settings (its document), any node's spec

    def _node_spec(self, node: int, store_host: str, store_port: int) -> NodeSpec:
        """``node``'s spec (:func:`ftrun.launch.node_spec.node_spec`); a standby's: the job's settings (its
        document), not its own command line's."""
        if self.job_spec is not None:
            return replace(self.job_spec, node_rank=node, spare="")
        return node_spec(self.cfg, self.job_id, self.target, self.args, node, store_host, store_port, self.bind,
                         self.job_run, self.slurm is not None)

    def _spawn(self, spec: NodeSpec) -> subprocess.Popen[bytes] | ForkedChild:
        """A supervisor for ``spec``: one forked by :func:`main`, else a new interpreter."""
        if self.pending:
            return self.pending.pop(0).hand(spec, self.secret)
        output = None
        if self.output_dir is not None:
            os.makedirs(self.output_dir, mode=0o700, exist_ok=True)
            output = open(os.path.join(self.output_dir, f"node{spec.node_rank}.log"), "ab")
        with output or contextlib.nullcontext():
            return start(output).hand(spec, self.secret)

    def _store_warning(self, message: str) -> None:
        self.events.emit("store_rejected", message)

    def _on_signal(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.signalled is not None and now - self.signalled_at < REPEAT_GAP:
            return  # the same stop delivered twice (to the process group, and relayed by a wrapper such as timeout)
        if self.signalled is not None:  # second Ctrl-C: no more grace (a final persist is given up)
            self.forced = True
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
        self.signalled, self.signalled_at = signum, now
        stop = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM  # what the supervisors say they got
        if self.pool is not None:
            self.pool.signal(stop)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(stop)
                proc.send_signal(signal.SIGCONT)  # a stopped one (SIGSTOP) keeps the stop pending, and the job with it

    def remove_files(self) -> None:
        """Remove the files this launcher wrote in the shm dir (the job secret, the announce file): at its end,
        and after a stop signal or a refusal that came while the job was starting (main())."""
        for path in self.files:
            with contextlib.suppress(FileNotFoundError):  # two launchers of a job may share this host
                os.unlink(path)
        self.files.clear()

    def _handle_signals(self) -> None:
        """--signals-to-handle: each listed signal stops the job as SIGTERM does (SIGINT and SIGTERM always do),
        except SIGUSR1 and SIGUSR2, which go on to every trainer (through the supervisors). A signal that stopped
        the start (main()) and is not listed gets its default action back. SIGUSR1 and SIGUSR2 not listed are
        ignored, in one line each (:meth:`_report_ignored`): SLURM sends them (``--signal=USR1@90``) to every
        process of a step, the trainers included, and their default action ended the job."""
        for sig in STARTUP_SIGNALS - {signal.SIGINT, signal.SIGTERM} - set(self.cfg.signals):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda signum, _: self.ignored.append(signal.Signals(signum)))
        for sig in self.cfg.signals:
            signal.signal(sig, self._forward_signal if sig in FORWARDED_SIGNALS else self._on_signal)

    def _report_ignored(self) -> None:
        """One line for each signal :meth:`_handle_signals` ignored since the last look (its handler only notes
        it: a line written from a handler could come in the middle of one being written)."""
        while self.ignored:
            name = self.ignored.pop(0).name
            where = ("SLURM sends it to every process of the step, the trainers included" if self.slurm is not None
                     else "list it there to pass it on to the trainers")
            self.events.emit("signal_ignored", f"{name} ignored: not in --signals-to-handle ({where})", signal=name)

    def _forward_signal(self, signum: int, frame: object) -> None:
        forwarded = FORWARDED_SIGNALS[signal.Signals(signum)]
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(forwarded)

    def run(self) -> int:
        become_subreaper()
        cfg = self.cfg
        if not cfg.standby:
            self.claims = hold_claim(self.job_id, range(cfg.nnodes) if cfg.local_mode
                                     else [] if cfg.node_rank is None else [cfg.node_rank])
        opened = open_control_store(cfg, self.bind, self.events)
        self.address, self.store_server = opened.address, opened.server
        store_host, store_port, raw_store = opened.host, opened.port, opened.client
        use_job(self.job_id, self.secret, self._store_warning)
        store = signed(raw_store, self.job_id)
        if cfg.standby:
            return self._run_standby(store, store_host, store_port)
        if self.slurm is not None:
            self.node_rank = agree_slurm_rank(store, self.job_id, self.slurm, cfg.rdzv_timeout, self.events)
        token = f"slurm-{self.slurm.job_id}.{self.slurm.step_id}" if self.slurm is not None else None
        self.job_run = open_run(store, self.job_id, token)
        if cfg.rank_by_store:
            taken = agree_rank(store, self.job_id, cfg.nnodes, self.job_run, self.events)
            if taken is None:
                return self._run_standby(store, store_host, store_port, f"all {cfg.nnodes} node ranks of run "
                                         f"{self.job_run} are taken: ")
            self.node_rank = taken
        coord = Coordinator(store, self.job_id, self.node_rank, cfg.nnodes, run=self.job_run)
        coord.init_job(job_doc(cfg, self.job_id, self.target, self.args))
        if cfg.ckpt_dir:  # before this launcher, or any of its keepers, touches the job's directory
            run_id = str((coord.job_doc() or {}).get("run_id"))
            self.dir_owner = hold_job_dir(job_dir(cfg.ckpt_dir, self.job_id), run_id, self.job_id,
                                          cfg.nnodes * cfg.nproc_per_node if cfg.resume else None, self.node_rank,
                                          self.events, self._slurm_job())
        self.files.append(secret_path(self.job_id))  # before they are written: a signal may stop the start
        write_secret_file(self.job_id, self.secret)  # for `ftrun status` on this host
        assert self.address is not None
        self.files.append(announce_path(self.job_id))
        announce_job(self.job_id, self.address.endpoint, cfg.nnodes, self.address.backend)
        nodes = range(cfg.nnodes) if cfg.local_mode else [self.node_rank]
        mode = ("local" if cfg.nnodes == 1 else f"all {cfg.nnodes} nodes simulated on this host: no --node-rank")
        mode = (mode if cfg.local_mode else f"node {self.node_rank} of {cfg.nnodes}"
                + (f", SLURM node {self.slurm.node_name}" if self.slurm else ""))
        self.events.emit("start", f"job {self.job_id}: {cfg.nnodes} node(s) x {cfg.nproc_per_node} trainer(s) "
                         f"({mode}), control store {store_host}:{store_port}, running {self.target}",
                         job_id=self.job_id, nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
                         store=f"{store_host}:{store_port}", node_rank=self.node_rank,
                         slurm_node=self.slurm.node_name if self.slurm else None)
        if self.no_zygote_because:
            settings = self.no_zygote_because
            names = sorted({setting.name for setting in settings})
            self.events.emit("no_zygote", "trainers start as new interpreters (as --no-zygote; restarts take seconds): "
                             f"{', '.join(setting.describe() for setting in settings[:3])} before it imports torch, "
                             "which reads it then; a trainer forked with torch imported would not. Set "
                             f"{', '.join(names)} on ftrun's command line (NAME=VALUE ftrun ...) for restarts in a "
                             "fraction of a second", variables=names)
        if not self.claims:  # its node rank agreed just now (SLURM, the store)
            self.claims = hold_claim(self.job_id, [self.node_rank])
        if cfg.ckpt_dir and not cfg.resume and self.node_rank == 0:
            move_steps_aside(job_dir(cfg.ckpt_dir, self.job_id), self.job_id, self.events)
        self._handle_signals()
        code = EXIT_FAILED
        try:
            for node in nodes:
                self.procs[node] = self._spawn(self._node_spec(node, store_host, store_port))
            if cfg.spares:
                self.pool = SparePool(cfg.spares, lambda name: self._spawn(
                    replace(self._node_spec(-1, store_host, store_port), spare=name)), self.events)
                self.pool.fill()
            if self.output_dir is not None and (self.slurm is None or self.slurm.node_id == 0):
                # one view of the whole job: under srun, whose output merges every node's, the step's first node
                # shows it; without a terminal (srun's output, a file) it is printed once, at the end
                self.view = LiveView(Console(stderr=True), plain_interval=None)
            code = self._wait(coord, store_host, store_port)
            if self.pool is not None:
                self.pool.stop(cfg.stop_grace)
            state = ("done" if code == 0 else "stopped" if self.signalled is not None else "left" if code == EXIT_LEFT
                     else "failed")
            if code != 0:  # a store that failed a supervisor gets no minute more (c10d's, or etcd's)
                raw_store.op_timeout = END_STORE_TIMEOUT
            try:
                self._end(coord, code, state, self._step_ended())
            except DistError as err:  # the control store went away (node 0's, or etcd without quorum)
                self.events.emit("failed", f"control store lost{' at the end of the job' if code == 0 else ''}, no "
                                 f"summary: {str(err).splitlines()[0]}{store_hint(cfg)}")
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            for pending in self.pending:  # not needed after all
                pending.cancel()
            if self.pool is not None:
                self.pool.stop(cfg.stop_grace)
            if self.dir_owner is not None:
                self.dir_owner.close()
            self.remove_files()
            kill_descendants(spare=left_by_user if code == 0 else None)  # what the supervisors let outlive a success
            # what supervisors killed before they could clean up left behind (one replaced while the job goes on
            # left its files, same names, to a replacement that may be on this host); in local mode also what a
            # killed earlier run of the job with more nodes left (every node of the job is on this host)
            # (a node whose SLURM step ended keeps them, and its claim on them, for the next step)
            for node in sorted(set(nodes) | nodes_with_files(self.job_id)) if self.cfg.local_mode else nodes:
                if self.cfg.local_mode or not (self._node_step_ended(node)
                                               or self.fencing.files_left_to_spare(node, self.procs.get(node))):
                    unlink_node_files(self.job_id, node)
            unlink_reserves(self.job_id)  # and spares killed while they held a reserve
            if self.slurm is not None and not self._step_ended():  # nothing left to claim
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(claim_path(self.job_id, self.slurm.node_name))
        return code

    def _step_ended(self) -> bool:
        """Whether this node's supervisor ended with its SLURM step, keeping its snapshots for the next step."""
        return any(self._node_step_ended(node) for node in self.procs)

    def _node_step_ended(self, node: int) -> bool:
        """Whether ``node``'s part of the job ended with its SLURM step, its snapshots kept for the next step: its
        supervisor said so (:data:`EXIT_STEP_ENDED`), or this launcher ended it, stalled, after the step had ended."""
        return node in self._step_over or (node in self.procs and self.procs[node].poll() == EXIT_STEP_ENDED)

    def _end(self, coord: Coordinator, code: int, state: str, step_ended: bool) -> None:
        """Record the end of the run, show the summary, and leave."""
        cfg = self.cfg
        if cfg.local_mode or self.signalled is not None or code in (0, EXIT_FAILED):
            # the run ended: a later launcher of this job id starts a new one (a lost node of a multi-node
            # job does not end it: its replacement joins the run)
            coord.store.set(coord.key("state"), state)
        if self.view is not None:
            self.view.update(gather(coord, settled=self._settled))
            self.view.close(f"job ended: {state}; output of every node and trainer in {self.output_dir}")
        elif self.output_dir is not None:  # --tui on a node of a SLURM step that does not show the view
            print(f"ftrun: node {coord.node_rank}'s output in {self.output_dir}", file=sys.stderr, flush=True)
        verdict = None
        if code == EXIT_LEFT:
            verdict = f"goes on without node {coord.node_rank}, which a spare replaced (exit code {code})"
        elif step_ended:
            verdict = f"ended its SLURM step (exit code {code}): run the step again to resume from RAM"
        print_summary(coord, code, self.job_id, verdict=verdict)
        if coord.get(WATCHED) is not None:  # an `ftrun status` view follows the job: let it see the end
            time.sleep(2 * LIVE_POLL_INTERVAL)
        if code == EXIT_LEFT and self.store_server is not None:
            host_until_the_run_ends(coord, self.events, self.cfg.node_timeout, lambda: self.signalled is not None)
        self._leave(coord, holds_rank=code != EXIT_LEFT)

    def _run_standby(self, store: SignedStore, store_host: str, store_port: int, why: str = "") -> int:
        """``--standby``, or a launcher that found every node rank taken (``why`` says so): join the job's current
        (or next) run as a hot spare; the exit code of the node rank it takes, or 0 when the run ends without
        needing it. Once it took a rank, this launcher is that node's: a supervisor of it that dies or stalls while the
        launcher lives is replaced here, as any node's (:meth:`_wait`)."""
        cfg = self.cfg
        assert self.address is not None
        run, doc = join_run(store, self.job_id, self.address.endpoint, cfg, self.target,
                            "--standby" if cfg.standby else "spare")
        self.job_run = run
        cfg.max_restarts = int(doc["max_restarts"])  # the job's: a lost node's replacement (_wait) counts to it
        name = f"standby-{socket.gethostname()}-{os.getpid()}"
        spec = standby_spec(self._node_spec(-1, store_host, store_port), doc, name)
        self.events.emit("start", f"job {self.job_id}: {why}standby {name} joins run {run} as a hot spare "
                         f"({doc['nnodes']} node(s) x {cfg.nproc_per_node} trainer(s)), control store "
                         f"{self.address.endpoint}", job_id=self.job_id, spare=name, run=run,
                         all_ranks_taken=bool(why))
        self._handle_signals()
        exit_code: int | None = None
        node: int | None = None  # the node rank its spare took
        coord = Coordinator(store, self.job_id, -1, int(doc["nnodes"]), run=run)
        exits = RestartLimit()  # of its spares that died while they waited
        try:
            proc = self.procs[-1] = self._spawn(spec)
            while True:
                node = self._spare_took(coord, name, proc)
                code = proc.returncode
                if node is None and code not in SUPERVISOR_ENDS:  # it took a rank, and died before a look saw it?
                    node = node_taken(coord, name)
                if (node is not None or code in SUPERVISOR_ENDS or self.signalled is not None
                        or not spare_died(coord, name, proc.pid, code, exits, cfg.nproc_per_node, self.events)):
                    break
                proc = self.procs[-1] = self._spawn(spec)  # a new spare, as --spares starts one
            if node is None or self.signalled is not None and code is not None:
                assert code is not None
                exit_code = spare_exit(code, self.signalled)
            else:  # its spare took node's rank (and runs it, or died since): this launcher is that node's now
                self.procs[node] = self.procs.pop(-1)
                self.job_spec, self.node_rank, coord.node_rank = spec, node, node
                self.fencing.handed_over(node, name)
                if spec.ckpt_dir and self.dir_owner is None and holds_node_0(coord, name):
                    # a spare that took node rank 0 holds the job's checkpoint directory for the run from then on
                    self.dir_owner = take_job_dir(spec.ckpt_dir, str(doc.get("run_id")), self.events,
                                                  self._slurm_job())
                exit_code = self._wait(coord, store_host, store_port)
        finally:
            if self.dir_owner is not None:
                self.dir_owner.close()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            kill_descendants(spare=left_by_user if exit_code == 0 else None)
            if node is not None and not self.fencing.files_left_to_spare(node, self.procs.get(node)):
                unlink_node_files(self.job_id, node)  # what its killed supervisors left
        assert exit_code is not None
        if exit_code != 0:  # as run(): a store that failed a supervisor gets no minute more
            store.raw.op_timeout = END_STORE_TIMEOUT
        with contextlib.suppress(DistError):  # the control store is gone, and the job with it: nobody to tell
            if self.job_spec is not None:
                self._leave(coord, holds_rank=exit_code != EXIT_LEFT)  # as the node it took
            else:  # as the node whose rank its spare took and held to the end, if it took one
                coord.node_rank = spare_rank(coord, name)  # (node 0's launcher waits for every node's goodbye)
                self._leave(coord)
        return exit_code

    def _spare_took(self, coord: Coordinator, name: str, proc: subprocess.Popen[bytes] | ForkedChild) -> int | None:
        """Wait while a standby's spare ``proc`` (``name``) waits: the node rank it took, as soon as a look sees it
        running that rank (from then on this launcher is that node's, and :meth:`_wait` kills and replaces its
        supervisor when it stalls, or replaces it when it dies), or None once it exited."""
        while proc.poll() is None:
            self._pause(IDLE_LOOK)
            node = node_taken(coord, name) if self.signalled is None else None
            if node is not None:
                return node
        return None

    def _slurm_job(self) -> str:
        """The SLURM job id of this launcher's step; "" outside SLURM."""
        return self.slurm.job_id if self.slurm is not None else ""

    def _wait(self, coord: Coordinator, store_host: str, store_port: int) -> int:
        """Wait for the supervisors; in local mode a lost node's rank goes to a hot spare, or (none left) to a
        replacement supervisor. So does the node's rank in a multi-node job (``--node-rank``, the form without it,
        ``srun``, a standby's once it took one): a supervisor that died while this launcher lives (the OOM killer, a
        crash; or stalled, killed here by :meth:`Fencing.end_lost`) is replaced here, its keeper re-adopting the node's
        slots, unless a ``--standby`` claims the rank
        first (the replacement takes it only from the lost incarnation, as a spare does: one of them gets it, and a
        replacement that lost leaves, exit code :data:`EXIT_REPLACED`), or had taken it before the supervisor died
        (:meth:`Fencing.left_to_spare`). Returns the job's exit code."""
        results: dict[int, int] = {}
        vacant: dict[int, int] = {}  # node -> its lost supervisor's exit code, while a spare takes the rank
        # node -> whether a spare had taken its rank, for each node whose supervisor this launcher killed
        # (Fencing.end_lost) and has not seen exit yet
        killed: dict[int, bool] = {}
        # a look at the nodes (_beat, Fencing.end_lost) at least four times per --node-timeout, however often the
        # loop runs; with --spares every FENCE_INTERVAL: a spare that took a stalled node's rank waits for its names
        # on this host
        look = FENCE_INTERVAL if self.pool is not None else min(IDLE_LOOK, self.cfg.node_timeout / 4)
        next_look = 0.0
        while len(results) < len(self.procs):
            if self.signalled is None and time.monotonic() >= next_look:
                next_look = time.monotonic() + look
                if self.slurm is not None:
                    self._beat(coord)
                killed.update(self.fencing.end_lost(coord, self.procs, set(killed)))
            for node, code in list(vacant.items()):
                if self._hand_over(coord, node):
                    del vacant[node]
                elif self.signalled is not None or self.pool is None or not self.pool.alive():
                    del vacant[node]  # no spare can take it (any more): as without spares
                    if self.signalled is not None:
                        results[node] = code
                    else:
                        held = owner(coord, node)[1]
                        self._replace(node, store_host, store_port, code, held.incarnation if held else 0)
            for node, proc in self.procs.items():
                if node in results or node in vacant or proc.poll() is None:
                    continue
                code = proc.returncode
                fenced = killed.pop(node, False)
                if (code == EXIT_REPLACED or fenced) and self.cfg.local_mode:
                    vacant[node] = code  # seen as lost while alive: a spare took its rank
                    continue
                if code not in SUPERVISOR_ENDS and self.signalled is None:
                    reason = f"node {node} lost: supervisor {describe_exit(code)}"
                    try:
                        held = owner(coord, node)[1]  # whom a spare took the rank from, or whose loss to declare
                        if not self.cfg.local_mode and self.fencing.left_to_spare(node, held, code):
                            results[node] = EXIT_REPLACED
                            continue
                        if self.slurm is not None and coord.current().kind == STEP_END_KIND:
                            self._step_over.add(node)  # the step ended (while it was stalled): nothing to replace
                            results[node] = code
                            continue
                        if not self.cfg.local_mode:  # a replacement follows: under srun the other nodes wait for
                            # it only when told so (rendezvous.nothing_replaces), as no other ftrun can join the step
                            coord.store.set(coord.key("node", node, "replacing"),
                                            str(held.incarnation if held is not None else 0))
                        # a peer that saw it silent (stalled before it died) may have declared the loss already:
                        # then the replacement follows without a second generation
                        raw, won = coord.current_raw(), False
                        if held is None or not coord.declared_lost(raw, node, held.incarnation):
                            raw, won = coord.bump(raw, Failure("node-lost", reason, node, None, "launcher",
                                                               incarnation=held.incarnation if held else None))
                    except DistError:  # the control store (node 0's launcher's, etcd) is gone, and the job with it
                        results[node] = code
                        continue
                    gen = Generation.decode(raw).gen
                    if won:
                        self.events.emit("failure", f"failure: {reason} (seen by launcher)", node=node,
                                         kind="node-lost", generation=gen)
                    if gen > self.cfg.max_restarts:  # no replacement: the other nodes stop at the limit too
                        results[node] = code
                        continue
                    if self.pool is not None and self.pool.alive():
                        vacant[node] = code
                    else:
                        self._replace(node, store_host, store_port, code, held.incarnation if held else 0)
                    break
                results[node] = code
            if self.pool is not None and self.signalled is None:
                self.pool.fill()
            reap_orphans([*self.procs.values(), *(self.pool.processes() if self.pool is not None else ()),
                          *(pending.proc for pending in self.pending)])
            if self.view is not None:
                self._refresh(coord)
            if len(results) < len(self.procs):  # (the last exit needs no wait)
                self._pause(_POLL_INTERVAL if vacant or self.pool is not None or self.view is not None else look)
        if self.signalled is None and {EXIT_STOPPED, EXIT_STOPPED_UNSAVED} & set(results.values()):
            self.signalled = _stop_signal(coord)  # a supervisor was told to stop, and the job stopped with it
        if self.signalled is not None:
            given_up = self.forced and self.cfg.ckpt_dir is not None
            if given_up:
                self.events.emit("durability", f"WARNING the final persist to {self.cfg.ckpt_dir} was given up: a "
                                 "second signal stopped the job at once", degraded=True, reason="forced stop")
            if given_up or EXIT_STOPPED_UNSAVED in results.values():
                return EXIT_UNSAVED
            return EXIT_INTERRUPTED if self.signalled == signal.SIGINT else 128 + self.signalled
        if all(code == EXIT_DONE for code in results.values()):
            return 0
        if EXIT_JOB_FAILED in results.values():
            return EXIT_FAILED
        return EXIT_LEFT if EXIT_REPLACED in results.values() else 1

    def _pause(self, timeout: float) -> None:
        """Until a supervisor of this launcher exits, or ``timeout`` seconds (:data:`_POLL_INTERVAL` where the
        kernel has no pidfds to wait on); then report the signals ignored meanwhile."""
        watched = self._exits.watch_only({proc.pid for proc in self.procs.values() if proc.returncode is None})
        select.select(self._exits.fds(), [], [], timeout if watched else min(timeout, _POLL_INTERVAL))
        self._report_ignored()

    def _beat(self, coord: Coordinator) -> None:
        """Under srun: this ftrun lives (:meth:`Coordinator.beat_launcher`), for each node it runs: the other nodes
        wait for a supervisor of it they lost (it may come back, or :meth:`Fencing.end_lost` has it replaced), and end
        the step for a lost node whose ftrun stopped beating (:func:`ftrun.launch.rendezvous.nothing_replaces`)."""
        with contextlib.suppress(DistError):  # the control store is away: nobody to tell
            for node in self.procs:
                coord.beat_launcher(node)

    def _replace(self, node: int, store_host: str, store_port: int, code: int, lost: int) -> None:
        """Start a replacement supervisor for ``node``, whose rank incarnation ``lost`` holds (0: none): in a
        multi-node job it claims the rank from that incarnation (:attr:`NodeSpec.replaces`), in local mode it takes
        it."""
        self.events.emit("node_lost", f"starting a replacement for node {node}", node=node, exit_code=code)
        self.fencing.replacing(node, lost)
        spec = self._node_spec(node, store_host, store_port)
        self.procs[node] = self._spawn(replace(spec, replaces=None if self.cfg.local_mode else lost))

    def _hand_over(self, coord: Coordinator, node: int) -> bool:
        """If one of this launcher's spares took ``node``'s rank, wait for it as that node's supervisor."""
        held = owner(coord, node)[1]
        proc = self.pool.adopt(held.spare) if self.pool is not None and held is not None and held.spare else None
        if proc is None:
            return False
        self.procs[node] = proc
        self.fencing.handed_over(node, held.spare)
        self.events.emit("spare_took", f"spare {held.spare} took node rank {node}; starting another spare",
                         node=node, spare=held.spare, incarnation=held.incarnation)
        return True

    def _refresh(self, coord: Coordinator) -> None:
        """Redraw the --tui view every :data:`PUBLISH_INTERVAL`."""
        now = time.monotonic()
        if now >= self._next_view:
            self._next_view = now + PUBLISH_INTERVAL
            assert self.view is not None
            self.view.update(gather(coord, settled=self._settled))

    def _leave(self, coord: Coordinator, holds_rank: bool = True) -> None:
        """Multi-node: leave the job (:func:`ftrun.launch.leaving.leave`), this launcher hosting the control store
        or not; nothing to say in local mode."""
        if not self.cfg.local_mode:
            leave(coord, self.store_server is not None, holds_rank)

class StartInterrupted(BaseException):
    """A stop signal came before the launcher handles it (its job not started): as KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def _interrupt(signum: int, frame: object) -> None:
    raise StartInterrupted(signum)


def fork_supervisor() -> PendingSupervisor:
    """A supervisor forked from this process, waiting for its spec: it shares this process's ``import torch``.
    Only before this process starts any thread or connection (see :mod:`ftrun.launch.handoff`)."""
    read, write = os.pipe()
    launcher = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the supervisor exits in supervisor_main; only its trainers come back, by SystemExit
        os.close(write)
        os.setsid()
        prepare_supervisor(launcher)
        supervisor_main(read)
    os.close(read)
    return PendingSupervisor(ForkedChild(pid), write)


def main() -> None:
    """``python -P -m ftrun.launch.launcher``, as :func:`ftrun.launch.handoff.exec_launcher` runs it."""
    set_process_name(LAUNCHER_NAME)
    cfg, begun, args = resume()
    # before any thread or connection of this process; --tui: each node's output goes to its own file, opened
    # when the node is known, so its supervisors are new interpreters. Local mode forks m more (at least one), kept
    # for the first nodes lost (or spares to start again), as many as parity lets the job lose at once: a new
    # interpreter and its imports take 2-3 s here
    reserve = max(1, cfg.erasure[1])
    count = 0 if cfg.tui else cfg.nnodes + cfg.spares + reserve if cfg.local_mode else 1
    if count and cfg.zygote and not cfg.no_python:
        preload()  # once for every zygote of this host (see ftrun.launch.zygote)
        size_blas(trainer_threads(os.environ, omp_threads(cfg)))  # before the forks
    pending = [fork_supervisor() for _ in range(count)]
    # a stop signal held since the exec (STARTUP_SIGNALS) ends the start cleanly, until the launcher handles it
    for sig in STARTUP_SIGNALS:
        signal.signal(sig, _interrupt)
    launcher: Launcher | None = None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTUP_SIGNALS)
        launcher = Launcher(cfg, begun, args, pending)
        code = launcher.run()  # it has cleaned up after the whole job
    except UsageError as err:
        print(error_line(str(err), [*sys.argv[1:], *os.environ.values()]), file=sys.stderr)
        if launcher is not None:  # refused while it started: what it wrote (the job's secret) goes
            launcher.remove_files()
        code = USAGE_EXIT_CODE
    except DistError as err:  # the control store went away before there was a job to end (a standby joining)
        print(f"ftrun: control store lost while joining the job: {str(err).splitlines()[0]}{store_hint(cfg)}",
              file=sys.stderr)
        if launcher is not None:
            launcher.remove_files()
        kill_descendants()
        code = EXIT_FAILED
    except StartInterrupted as stop:
        signal.pthread_sigmask(signal.SIG_BLOCK, STARTUP_SIGNALS)
        print(f"ftrun: stopped by {stop.signal.name} while the job was starting", file=sys.stderr)
        if launcher is not None:
            launcher.remove_files()
        kill_descendants()
        code = EXIT_INTERRUPTED if stop.signal == signal.SIGINT else 128 + stop.signal
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips tearing down torch at interpreter exit (about 0.5 s, with nothing left to do)


if __name__ == "__main__":
    main()
