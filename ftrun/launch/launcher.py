"""The launcher: the ``ftrun`` process a user starts. It owns the control store and the supervisors.

- Local mode (no ``--node-rank``): hosts the control store and starts one supervisor per simulated node. A
  supervisor that dies by a signal or crashes is a lost node: a replacement takes the same node rank.
- Multi-node mode (``--node-rank`` and ``--rdzv-endpoint``): starts this node's supervisor, and a replacement
  when it dies while this launcher lives (unless a hot spare claims the rank first), or stalls: it kills one
  that still runs ``--node-timeout`` after the job declared it lost (:meth:`Launcher._end_lost`, in every mode);
  node 0 hosts the control
  store unless one already runs at the endpoint (``ftrun store``). Under ``srun`` the first node of the
  step hosts it, and the nodes agree their node ranks first (:func:`ftrun.launch.slurm.agree_node_rank`), so a
  node keeps the rank whose snapshots it holds from an earlier step of the job. A launcher that starts a
  replacement says so in the control store (``node/<r>/replacing``): under srun the other nodes wait only for
  such a replacement or a spare, and otherwise end the step, keeping their snapshots and claim files for the next.
- torchrun's multi-node form, ``--rdzv-endpoint`` and ``--nnodes`` > 1 without ``--node-rank`` (:attr:`JobConfig.
  rank_by_store`): every launcher on the endpoint's host tries to host the store (the first to bind the port
  does, the others join), then each takes the lowest free node rank of the run by compare-and-set
  (:func:`ftrun.control.ownership.claim_free_rank`) before its supervisor gets its spec; one that finds every
  rank taken joins as a hot spare, as ``--standby`` does.
- A standby (``--standby``): starts a hot spare; once the spare took a lost node's rank, the launcher is that
  node's and replaces its supervisor as above.

It forwards SIGINT/SIGTERM to the supervisors as a graceful stop, prints the job summary, and, as a child
subreaper, kills whatever descendant is left before it exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import replace

import psutil
from rich.console import Console
from torch.distributed import DistError, TCPStore

from ftrun.launch.config import JobConfig
from ftrun.errors import USAGE_EXIT_CODE, UsageError, error_line
from ftrun.events import EventLog
from ftrun.control.backend import OutageReport, StoreAddress, open_store
from ftrun.control.coordination import Coordinator, Failure, Generation, current_run, open_run, signed, use_job
from ftrun.control.ownership import Owner, claim_free_rank, owner, retire_spare, spares
from ftrun.control.signed import SignedStore
from ftrun.launch.clean import claim_nodes
from ftrun.launch.handoff import STARTUP_SIGNALS, Begun, PendingSupervisor, prepare_supervisor, resume, start
from ftrun.launch.env import default_omp_threads, trainer_threads
from ftrun.launch.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LEFT, EXIT_UNSAVED
from ftrun.launch.peers import SpareWatch
from ftrun.launch.resume_dir import move_steps_aside, prepare_resume
from ftrun.launch.processes import (LAUNCHER_NAME, RESTART_WINDOW, ExitWatch, ForkedChild, RestartLimit,
                                    become_subreaper, describe_exit, kill_descendants, left_by_user, reap_orphans,
                                    set_process_name)
from ftrun.launch.supervisor import main as supervisor_main
from ftrun.launch.zygote import preload, size_blas
from ftrun.control.secret import local_secret, secret_path, shared_secret, write_secret_file
from ftrun.launch.spare import SPARE_BEAT
from ftrun.launch.spare_pool import SparePool
from ftrun.launch.slurm import SlurmStep, agree_node_rank, claim_path, read_claim, slurm_step
from ftrun.control.spec import (EXIT_DONE, EXIT_JOB_FAILED, EXIT_REPLACED, EXIT_STEP_ENDED, EXIT_STOPPED,
                                EXIT_STOPPED_UNSAVED, FORWARDED_SIGNALS, NodeSpec, STEP_END_KIND, STOP_KIND,
                                announce_path, nodes_with_files, shm_place, split_endpoint, unlink_node_files,
                                write_shm_file)
from ftrun.control.store import (LOOPBACK, WILDCARDS, C10dStore, Store, check_bind_address, host_store,
                                 route_address)
from ftrun.ui.summary import Recovery, print_summary
from ftrun.snapshot.dir_owner import DirOwner, check as check_dir_owner
from ftrun.snapshot.persist import job_dir
from ftrun.snapshot.reserve import SlotReserve, unlink_reserves
from ftrun.ui.live import POLL_INTERVAL as LIVE_POLL_INTERVAL, WATCHED, LiveView
from ftrun.ui.status import PUBLISH_INTERVAL, gather

# A second stop signal within this many seconds of the first is the same stop delivered twice (a signal to the
# process group that a wrapper such as `timeout` relays too); a later one stops the job at once (no final persist)
REPEAT_GAP = 1.0
_ACK_TIMEOUT = 10.0
# a spare whose record says it waits but whose beats stopped this long, at the job's end, is gone (killed while it
# waited): a live one sees the end within its poll and says so
SPARE_SILENCE = 4 * SPARE_BEAT
_HOST_LOOK = 0.5  # seconds between two looks of a store host whose node left while the job goes on
END_STORE_TIMEOUT = 5.0  # seconds a failed job's summary waits for a store operation (a frozen store host)
_POLL_INTERVAL = 0.02
# seconds between two looks of a launcher whose supervisors' exits wake it (pidfds) and that has nothing else to
# look after (no spares, no vacant node rank, no --tui view)
IDLE_LOOK = 1.0
FENCE_INTERVAL = 0.1  # seconds between two looks of a launcher with --spares at the nodes it runs (_end_lost)
# a supervisor's exit codes that end its node's part of the job; any other is a lost supervisor (killed, crashed)
SUPERVISOR_ENDS = (EXIT_DONE, EXIT_JOB_FAILED, EXIT_STOPPED, EXIT_STOPPED_UNSAVED, EXIT_REPLACED, EXIT_STEP_ENDED)


def is_local_host(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise UsageError(f"--rdzv-endpoint host {host!r} does not resolve") from None
    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ipaddress.ip_address(a).is_loopback or a in local for a in addresses)


def script_digest(cfg: JobConfig, target: str) -> str:
    """What the script is, by content: a spare that joins must run the same one (paths may differ by host)."""
    if cfg.module:
        return f"module {target}"
    with open(os.path.join(target, "__main__.py") if os.path.isdir(target) else target, "rb") as f:
        return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()


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
        self.address: StoreAddress | None = None  # where the control store is (set by _open_store)
        self.procs: dict[int, subprocess.Popen[bytes] | ForkedChild] = {}
        self.pool: SparePool | None = None  # --spares
        self._exits = ExitWatch()  # see _pause
        self._spare_of: dict[int, str] = {}  # node -> the spare whose process supervises it now (handed over)
        # nodes whose files on this host are a spare's now: it took the rank after their killed supervisor stalled
        self._kept_files: set[int] = set()
        # (_end_lost) node -> the incarnation that held its rank when this launcher started its supervisor's
        # replacement (a lost owner of that incarnation is not the replacement, which has yet to take the rank), and
        # since when (time.monotonic()) its supervisor runs on though the job lost it; under srun the nodes whose
        # supervisor it ended after their step had ended (their snapshots stay for the next step, as that one's)
        self._replaced: dict[int, int] = {}
        self._stalled: dict[int, float] = {}
        self._step_over: set[int] = set()
        self.signalled: int | None = None
        self.files: list[str] = []  # what this launcher wrote in the shm dir (removed by remove_files())
        self.claims: list[socket.socket] = []  # this host's claim on the job's nodes, held for life (_claim)
        self.signalled_at = 0.0  # time.monotonic() of the signal that began the stop
        self.forced = False  # a second signal stopped the job at once
        self.ignored: list[signal.Signals] = []  # SIGUSR1/SIGUSR2 not in --signals-to-handle, not reported yet
        # signs every control-store value (and authenticates keepers to each other); never given to trainers
        self.secret = local_secret() if cfg.local_mode else shared_secret(self.job_id, cfg.secret_file)
        self.bind = self._bind_address()
        self.job_run = 0  # the job's run in the control store (taken or joined in run())
        self.dir_owner: DirOwner | None = None  # node 0's hold on the job's --ckpt-dir directory
        self.job_spec: NodeSpec | None = None  # a standby's: the job's settings (its document), any node's spec

    def _bind_address(self) -> str:
        """The address this node's listening sockets bind: loopback in local mode, else ``--rdzv-bind`` (checked),
        ``--local-addr`` (an address of this host), or the address of the interface that reaches the control
        store's host."""
        cfg = self.cfg
        if cfg.local_mode:
            return LOOPBACK
        if cfg.rdzv_bind is not None:
            return check_bind_address(cfg.rdzv_bind)
        if cfg.local_addr is not None:
            return check_bind_address(cfg.local_addr, "--local-addr")
        assert cfg.rdzv_endpoint is not None
        return route_address(*split_endpoint(cfg.rdzv_endpoint.split(",")[0]))

    def _open_store(self) -> tuple[str, int, Store]:
        """Host or join the control store; returns (host, port, client) and sets :attr:`address`. With etcd,
        host and port are the first member's."""
        cfg = self.cfg
        report = OutageReport(lambda message: self.events.emit("store_outage", message))
        if cfg.rdzv_backend == "etcd":
            assert cfg.rdzv_endpoint is not None
            self.address = StoreAddress("etcd", cfg.rdzv_endpoint, cfg.store_conf)
            host, port = split_endpoint(cfg.rdzv_endpoint.split(",")[0])
            return host, port, open_store(self.address, cfg.rdzv_timeout, report)
        if cfg.local_mode:
            host, port = split_endpoint(cfg.rdzv_endpoint, any_port=True) if cfg.rdzv_endpoint else (LOOPBACK, 0)
            if cfg.rdzv_endpoint and not is_local_host(host):
                raise UsageError(f"--rdzv-endpoint {cfg.rdzv_endpoint} is not on this host, but a job of this host "
                                 "alone hosts its control store here: give 127.0.0.1:PORT, or --node-rank N for a "
                                 "node of a multi-node job")
            self.store_server = host_store(port, bind=LOOPBACK, flag=cfg.endpoint_flag)
            self.address = StoreAddress("c10d", f"{LOOPBACK}:{self.store_server.port}")
            return LOOPBACK, self.store_server.port, C10dStore(self.store_server)
        assert cfg.rdzv_endpoint is not None
        host, port = split_endpoint(cfg.rdzv_endpoint)
        self.address = StoreAddress("c10d", cfg.rdzv_endpoint)
        # node 0 hosts it; without node ranks yet (rank_by_store) every launcher on the endpoint's host tries to,
        # as torchrun's is_host: the first binds the port, the others (and all when an `ftrun store` serves it) join
        if (cfg.node_rank == 0 or cfg.rank_by_store) and is_local_host(host):
            try:
                self.store_server = host_store(port, bind=self.bind, flag=cfg.endpoint_flag)
                return host, port, C10dStore(self.store_server)
            except UsageError:
                pass  # an `ftrun store` may already serve this endpoint: join it, or say it is not a store
        return host, port, open_store(self.address, cfg.rdzv_timeout, report,
                                      waiting=lambda message: self.events.emit("store_wait", message))

    def _master_addr(self, store_host: str) -> str:
        """This node's address as peers reach it: ``--local-addr``, else the bound address, else (bound to every
        interface) the host. A job of this host alone listens on loopback only, whatever --local-addr says."""
        if self.cfg.local_addr is not None and not self.cfg.local_mode:
            return self.cfg.local_addr
        if self.bind not in WILDCARDS:
            return self.bind
        if ipaddress.ip_address(socket.gethostbyname(store_host)).is_loopback:
            return LOOPBACK
        return socket.gethostname()

    def _node_spec(self, node: int, store_host: str, store_port: int) -> NodeSpec:
        if self.job_spec is not None:  # a standby's: the job's, not its own command line's
            return replace(self.job_spec, node_rank=node, spare="")
        cfg = self.cfg
        return NodeSpec(
            job_id=self.job_id, node_rank=node, nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
            store_host=store_host, store_port=store_port, master_addr=self._master_addr(store_host),
            target=self.target, args=self.args, module=cfg.module, no_python=cfg.no_python, cwd=os.getcwd(),
            omp_threads=_omp_threads(cfg), max_restarts=cfg.max_restarts,
            rdzv_timeout=cfg.rdzv_timeout, hang_timeout=cfg.hang_timeout,
            hang_timeout_initial=cfg.hang_timeout_initial, hang_step_factor=cfg.hang_step_factor,
            node_timeout=cfg.node_timeout, stop_grace=cfg.stop_grace, zygote=cfg.zygote,
            ec_group=cfg.erasure[0], ec_parity=cfg.erasure[1], ec_backend=cfg.ec_backend,
            ckpt_dir=job_dir(cfg.ckpt_dir, self.job_id) if cfg.ckpt_dir else None, persist_every=cfg.persist_every,
            keep=cfg.keep, ckpt_format=cfg.ckpt_format, persist_grace=cfg.persist_grace,
            log_dir=os.path.abspath(cfg.log_dir) if cfg.log_dir else None, faults=cfg.inject,
            bind_addr=self.bind, run=self.job_run, rdzv_backend=cfg.rdzv_backend,
            rdzv_endpoint=cfg.rdzv_endpoint or "" if cfg.rdzv_backend == "etcd" else "", rdzv_conf=cfg.store_conf,
            monitor_interval=cfg.monitor_interval, role=cfg.role, signals_to_handle=cfg.signals_to_handle,
            virtual_local_rank=cfg.virtual_local_rank, redirects=cfg.redirects, tee=cfg.tee,
            local_ranks_filter=cfg.local_ranks_filter, duplicate_stdout_filters=cfg.duplicate_stdout_filters,
            duplicate_stderr_filters=cfg.duplicate_stderr_filters, label_output=cfg.label_output,
            slurm_step=self.slurm is not None)

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
            self._claim(range(cfg.nnodes) if cfg.local_mode else [] if cfg.node_rank is None else [cfg.node_rank])
        store_host, store_port, raw_store = self._open_store()
        use_job(self.job_id, self.secret, self._store_warning)
        store = signed(raw_store, self.job_id)
        if cfg.standby:
            return self._run_standby(store, store_host, store_port)
        if self.slurm is not None:
            self._agree_slurm_rank(store)
        token = f"slurm-{self.slurm.job_id}.{self.slurm.step_id}" if self.slurm is not None else None
        self.job_run = open_run(store, self.job_id, token)
        if cfg.rank_by_store and not self._agree_rank(store):
            return self._run_standby(store, store_host, store_port, f"all {cfg.nnodes} node ranks of run "
                                     f"{self.job_run} are taken: ")
        coord = Coordinator(store, self.job_id, self.node_rank, cfg.nnodes, run=self.job_run)
        coord.init_job(self._job_doc())
        if cfg.ckpt_dir:  # before this launcher, or any of its keepers, touches the job's directory
            self._hold_job_dir(job_dir(cfg.ckpt_dir, self.job_id), str((coord.job_doc() or {}).get("run_id")))
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
            self._claim([self.node_rank])
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
                if self.cfg.local_mode or not (self._node_step_ended(node) or self._files_left_to_spare(node)):
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
            self._host_until_the_run_ends(coord)
        self._leave(coord, holds_rank=code != EXIT_LEFT)

    def _job_doc(self) -> dict[str, object]:
        """What every node, and a spare that joins, learns of the job from the control store."""
        cfg = self.cfg
        return {"nnodes": cfg.nnodes, "nproc_per_node": cfg.nproc_per_node, "max_restarts": cfg.max_restarts,
                "target": self.target, "script": script_digest(cfg, self.target), "args": self.args,
                "module": cfg.module, "no_python": cfg.no_python,
                "ec": [*cfg.erasure, cfg.ec_backend], "persist": [cfg.persist_every, cfg.keep, cfg.ckpt_format],
                "ckpt_dir": job_dir(cfg.ckpt_dir, self.job_id) if cfg.ckpt_dir else None,
                "run_id": secrets.token_hex(8)}  # the run's, whichever launcher wrote it: see dir_owner

    def _run_standby(self, store: SignedStore, store_host: str, store_port: int, why: str = "") -> int:
        """``--standby``, or a launcher that found every node rank taken (``why`` says so): join the job's current
        (or next) run as a hot spare; the exit code of the node rank it takes, or 0 when the run ends without
        needing it. Once it took a rank, this launcher is that node's: a supervisor of it that dies or stalls while the
        launcher lives is replaced here, as any node's (:meth:`_wait`)."""
        cfg = self.cfg
        assert self.address is not None
        flag = "--standby" if cfg.standby else "spare"
        deadline = time.monotonic() + cfg.rdzv_timeout
        while True:
            run = current_run(store, self.job_id)
            doc = Coordinator(store, self.job_id, -1, 1, run=run).job_doc() if run else None
            if doc is not None and store.get(f"ftrun/{self.job_id}/{run}/state") is None:
                break
            if time.monotonic() > deadline:
                raise UsageError(f"{flag}: no running job {self.job_id} at {self.address.endpoint} "
                                 f"within {cfg.rdzv_timeout:g}s")
            time.sleep(0.1)
        assert run is not None
        if int(doc["nproc_per_node"]) != cfg.nproc_per_node:
            raise UsageError(f"{flag}: the job runs {doc['nproc_per_node']} trainer(s) per node, this spare "
                             f"--nproc-per-node {cfg.nproc_per_node}; not joining")
        if doc.get("script") != script_digest(cfg, self.target):
            raise UsageError(f"{flag}: {self.target} is not the job's script ({doc.get('target')}: contents "
                             "differ); not joining")
        self.job_run = run
        cfg.max_restarts = int(doc["max_restarts"])  # the job's: a lost node's replacement (_wait) counts to it
        group, parity, backend = doc["ec"]
        every, keep, ckpt_format = doc["persist"]
        base = self._node_spec(-1, store_host, store_port)
        name = f"standby-{socket.gethostname()}-{os.getpid()}"
        spec = replace(base, nnodes=int(doc["nnodes"]), args=list(doc["args"]), ec_group=int(group),
                       ec_parity=int(parity), ec_backend=str(backend), persist_every=int(every), keep=int(keep),
                       ckpt_format=str(ckpt_format), ckpt_dir=doc["ckpt_dir"], spare=name)
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
                    node = self._node_taken(coord, name)
                if (node is not None or code in SUPERVISOR_ENDS or self.signalled is not None
                        or not self._spare_died(coord, name, proc.pid, code, exits)):
                    break
                proc = self.procs[-1] = self._spawn(spec)  # a new spare, as --spares starts one
            if node is None or self.signalled is not None and code is not None:
                assert code is not None
                exit_code = self._spare_exit(code)
            else:  # its spare took node's rank (and runs it, or died since): this launcher is that node's now
                self.procs[node] = self.procs.pop(-1)
                self.job_spec, self.node_rank, coord.node_rank = spec, node, node
                self._spare_of[node] = name
                if spec.ckpt_dir and self.dir_owner is None:
                    self._hold_if_node_0(coord, name, spec.ckpt_dir, str(doc.get("run_id")))
                exit_code = self._wait(coord, store_host, store_port)
        finally:
            if self.dir_owner is not None:
                self.dir_owner.close()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            kill_descendants(spare=left_by_user if exit_code == 0 else None)
            if node is not None and not self._files_left_to_spare(node):
                unlink_node_files(self.job_id, node)  # what its killed supervisors left
        assert exit_code is not None
        if exit_code != 0:  # as run(): a store that failed a supervisor gets no minute more
            store.raw.op_timeout = END_STORE_TIMEOUT
        with contextlib.suppress(DistError):  # the control store is gone, and the job with it: nobody to tell
            if self.job_spec is not None:
                self._leave(coord, holds_rank=exit_code != EXIT_LEFT)  # as the node it took
            else:
                self._leave_as_spare(store, name, int(doc["nnodes"]))
        return exit_code

    def _spare_took(self, coord: Coordinator, name: str, proc: subprocess.Popen[bytes] | ForkedChild) -> int | None:
        """Wait while a standby's spare ``proc`` (``name``) waits: the node rank it took, as soon as a look sees it
        running that rank (from then on this launcher is that node's, and :meth:`_wait` kills and replaces its
        supervisor when it stalls, or replaces it when it dies), or None once it exited."""
        while proc.poll() is None:
            self._pause(IDLE_LOOK)
            node = self._node_taken(coord, name) if self.signalled is None else None
            if node is not None:
                return node
        return None

    def _spare_died(self, coord: Coordinator, name: str, pid: int, code: int, exits: RestartLimit) -> bool:
        """A standby's spare (process ``pid``) died (``code``) before it took a rank: the OOM killer, a crash. Its
        record says "gone" from now on and its reserve is unlinked. True when it had been waiting and its spares
        did not die too often (``exits``, :class:`RestartLimit`): then this launcher starts another, as
        ``--spares`` does; False when it died before it enlisted (it would again), or too often."""
        SlotReserve(self.job_id, name, self.cfg.nproc_per_node).release()
        try:
            waited = retire_spare(coord, name, pid)
        except DistError:  # the control store is gone, and the job with it
            waited = False
        again = waited and not exits.reached()
        then = ("starting another" if again else "it never enlisted: this standby ends" if not waited
                else f"its spares died {len(exits)} times within {RESTART_WINDOW:g}s: this standby ends")
        self.events.emit("spare_gone", f"spare {name} (pid {pid}) {describe_exit(code)} while it waited for a lost "
                         f"node; {then}", spare=name, exit_code=code, restarted=again)
        return again

    def _spare_exit(self, code: int) -> int:
        """The exit code of a standby whose supervisor exited with ``code`` (it ran no node, or it ended its
        node's part of the job)."""
        if code == EXIT_DONE:
            return 0
        if code in (EXIT_STOPPED, EXIT_STOPPED_UNSAVED) or self.signalled is not None:
            return EXIT_UNSAVED if code == EXIT_STOPPED_UNSAVED else 128 + (self.signalled or signal.SIGTERM)
        return EXIT_FAILED if code == EXIT_JOB_FAILED else EXIT_LEFT if code == EXIT_REPLACED else 1

    def _node_taken(self, coord: Coordinator, spare: str) -> int | None:
        """The node rank that ``spare`` took, as the spares' registry says (it stays so after another spare took
        the rank from it); None when it took none, or the control store is gone."""
        try:
            docs = spares(coord)
        except DistError:
            return None
        return next((doc.node for doc in docs if doc.name == spare and doc.state == "took"), None)

    def _hold_if_node_0(self, coord: Coordinator, spare: str, root: str, run_id: str) -> None:
        """A spare that took node rank 0 holds the job's checkpoint directory for the run from then on."""
        with contextlib.suppress(DistError):
            if getattr(owner(coord, 0)[1], "spare", None) == spare:
                self._take_job_dir(root, run_id)

    def _agree_rank(self, store: SignedStore) -> bool:
        """torchrun's multi-node form without --node-rank (:attr:`JobConfig.rank_by_store`): take the lowest node
        rank of the run no launcher took yet; False when every rank is taken (this launcher is then a spare)."""
        me = f"{socket.gethostname()}-{os.getpid()}"
        taken = claim_free_rank(Coordinator(store, self.job_id, -1, self.cfg.nnodes, run=self.job_run), me,
                                socket.gethostname())
        if taken is None:
            return False
        self.node_rank = taken
        self.events.emit("node_rank", f"node rank {taken} agreed through the control store (run {self.job_run}: "
                         "first come, first served; no --node-rank given)", node_rank=taken, run=self.job_run)
        return True

    def _agree_slurm_rank(self, store: SignedStore) -> None:
        """Under srun: take the node rank whose snapshots this node holds from an earlier step, or a free one."""
        assert self.slurm is not None
        step = self.slurm
        claim = read_claim(self.job_id, step.node_name)
        self.node_rank = agree_node_rank(store, self.job_id, step, claim, self.cfg.rdzv_timeout)
        why = ("kept: its snapshots from an earlier step are in this node's RAM" if claim == self.node_rank
               else "new to this job: earlier snapshots of its ranks, if any, come from parity or disk"
               if claim is None else f"its rank {claim} went to another node")
        self.events.emit("slurm_step", f"SLURM step {step.job_id}.{step.step_id} on {step.node_name}: node rank "
                         f"{self.node_rank} ({why})", slurm_node=step.node_name, node_rank=self.node_rank,
                         claimed=claim, slurm_step=f"{step.job_id}.{step.step_id}")

    def _claim(self, nodes: Iterable[int]) -> None:
        """Hold this host's claim on the job's ``nodes`` for the launcher's life (:func:`claim_nodes`); a
        UsageError when another launcher of the job holds one."""
        self.claims, problem = claim_nodes(self.job_id, nodes)
        if problem:
            raise UsageError(f"{problem}: stop it first, or choose another --rdzv-id")

    def _hold_job_dir(self, root: str, run_id: str) -> None:
        """Refuse to start beside a live run of this job that holds ``root``, or where ``root`` is there but is no
        directory (a file, a link to none or a loop: nothing could be persisted), a UsageError; on node 0, hold it for
        this run (:mod:`ftrun.snapshot.dir_owner`), after the checks and repairs of a resume."""
        if os.path.lexists(root) and not os.path.isdir(root):
            raise UsageError(f"--ckpt-dir: this job's directory {root} is not a directory (a file, or a link that "
                             "leads to none): nothing could be persisted there; move it away")
        dead = check_dir_owner(root, run_id, self.job_id, lambda line: self.events.emit("ckpt_dir", line),
                               self._slurm_job())
        if dead is not None:
            self.events.emit("ckpt_dir", f"{root} was held by a run of job {self.job_id} that is gone "
                             f"({dead.describe()}): taken over", host=dead.host, pid=dead.pid)
        if self.cfg.resume:
            prepare_resume(root, self.job_id, self.cfg.nnodes * self.cfg.nproc_per_node, self.events)
        if self.node_rank == 0:
            self._take_job_dir(root, run_id)

    def _take_job_dir(self, root: str, run_id: str) -> None:
        """Hold ``root`` for run ``run_id`` until the launcher ends (:class:`DirOwner`)."""
        self.dir_owner = DirOwner(root, run_id, lambda line: self.events.emit("ckpt_dir", f"WARNING {line}"),
                                  self._slurm_job())
        self.dir_owner.take()

    def _slurm_job(self) -> str:
        """The SLURM job id of this launcher's step; "" outside SLURM."""
        return self.slurm.job_id if self.slurm is not None else ""

    def _wait(self, coord: Coordinator, store_host: str, store_port: int) -> int:
        """Wait for the supervisors; in local mode a lost node's rank goes to a hot spare, or (none left) to a
        replacement supervisor. So does the node's rank in a multi-node job (``--node-rank``, the form without it,
        ``srun``, a standby's once it took one): a supervisor that died while this launcher lives (the OOM killer, a
        crash; or stalled, killed here by :meth:`_end_lost`) is replaced here, its keeper re-adopting the node's
        slots, unless a ``--standby`` claims the rank
        first (the replacement takes it only from the lost incarnation, as a spare does: one of them gets it, and a
        replacement that lost leaves, exit code :data:`EXIT_REPLACED`), or had taken it before the supervisor died
        (:meth:`_left_to_spare`). Returns the job's exit code."""
        results: dict[int, int] = {}
        vacant: dict[int, int] = {}  # node -> its lost supervisor's exit code, while a spare takes the rank
        # node -> whether a spare had taken its rank, for each node whose supervisor this launcher killed (_end_lost)
        # and has not seen exit yet
        killed: dict[int, bool] = {}
        # a look at the nodes (_beat, _end_lost) at least four times per --node-timeout, however often the loop runs;
        # with --spares every FENCE_INTERVAL: a spare that took a stalled node's rank waits for its names on this host
        look = FENCE_INTERVAL if self.pool is not None else min(IDLE_LOOK, self.cfg.node_timeout / 4)
        next_look = 0.0
        while len(results) < len(self.procs):
            if self.signalled is None and time.monotonic() >= next_look:
                next_look = time.monotonic() + look
                if self.slurm is not None:
                    self._beat(coord)
                killed.update(self._end_lost(coord, set(killed)))
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
                        if not self.cfg.local_mode and self._left_to_spare(node, held, code):
                            results[node] = EXIT_REPLACED
                            continue
                        if self.slurm is not None and coord.current().kind == STEP_END_KIND:
                            self._step_over.add(node)  # the step ended (while it was stalled): nothing to replace
                            results[node] = code
                            continue
                        if not self.cfg.local_mode:  # a replacement follows: under srun the other nodes wait for
                            # it only when told so (supervisor.nothing_replaces), as no other ftrun can join the step
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
        wait for a supervisor of it they lost (it may come back, or :meth:`_end_lost` replaces it), and end the
        step for a lost node whose ftrun stopped beating (:func:`ftrun.launch.supervisor.nothing_replaces`)."""
        with contextlib.suppress(DistError):  # the control store is away: nobody to tell
            for node in self.procs:
                coord.beat_launcher(node)

    def _end_lost(self, coord: Coordinator, skip: set[int]) -> dict[int, bool]:
        """SIGKILL this launcher's supervisor of each node (but ``skip``: killed already) that the job no longer
        counts on while it still runs (stalled: stopped, frozen, cut off): at once when a spare took the node's rank
        (:meth:`_taken_by_spare`), ``--node-timeout`` after this launcher saw the other nodes declare it lost
        (``node/<r>/lost`` names its incarnation) otherwise. A supervisor never declared lost (slow, however slow) is
        never killed, nor one that rejoined in time (that clears ``node/<r>/lost``), nor a replacement that has not
        taken the rank yet (:attr:`_replaced`). Its keeper, zygote and trainers die with it (PR_SET_PDEATHSIG, a
        stopped process too), freeing the node's names on this host (the keeper's socket, its files in /dev/shm,
        the heartbeat table) for a spare here; its exit is a lost supervisor's (:meth:`_wait`): left to the spare,
        else replaced here, its keeper re-adopting the node's snapshots (under srun, the step having ended, the end
        of this node's part, its snapshots kept for the next step). Waited on, it held up the job until
        ``--rdzv-timeout`` (under srun its step for ever). Returns the nodes killed, each with whether a spare had
        taken its rank."""
        now = time.monotonic()
        killed: dict[int, bool] = {}
        for node, proc in self.procs.items():
            if node in skip or proc.poll() is not None:
                self._stalled.pop(node, None)
                continue
            try:
                verdict = self._fence_verdict(coord, node, self._spare_of.get(node), self._replaced.get(node, 0),
                                              self._stalled, self.cfg.node_timeout, now)
            except DistError:  # the control store is away: nothing to tell (the supervisor waits for it too)
                continue
            if verdict is None:
                continue
            held, taken = verdict
            proc.send_signal(signal.SIGKILL)
            killed[node] = taken
            if taken:
                self.events.emit("fenced", f"node {node}'s supervisor (pid {proc.pid}) still ran after spare "
                                 f"{held.spare} took its rank: killed, with its keeper and trainers", node=node,
                                 spare=held.spare, pid=proc.pid)
            else:
                self.events.emit("stalled", f"node {node}'s supervisor (pid {proc.pid}) still ran "
                                 f"{self.cfg.node_timeout:g}s after the job lost it (stalled: stopped, frozen?): "
                                 "killed, with its keeper and trainers", node=node, pid=proc.pid)
        return killed

    @staticmethod
    def _fence_verdict(coord: Coordinator, node: int, handed_to: str | None, replaced: int,
                       stalled: dict[int, float], node_timeout: float, now: float) -> tuple[Owner, bool] | None:
        """:meth:`_end_lost`'s decision for ``node``, whose supervisor here still runs: its owner and whether a
        spare took the rank (:meth:`_taken_by_spare`) when the supervisor is to be killed, else None. Killed at
        once when a spare took the rank; when the owner was declared lost (``node/<r>/lost`` names its incarnation,
        newer than ``replaced``: see :meth:`_taken_by_spare`), once ``now`` is more than ``node_timeout`` after the
        first look that saw it so (kept in ``stalled``, by node, until the node is killed or no longer lost).
        Invariant: a supervisor whose rank no spare took and whose loss no node declared is never killed, however
        slow."""
        held = owner(coord, node)[1]
        taken = Launcher._taken_by_spare(held, handed_to, replaced)
        declared = (held is not None and not taken and held.incarnation > replaced
                    and coord.get("node", node, "lost") == str(held.incarnation).encode())
        if held is None or not (taken or declared):
            stalled.pop(node, None)
            return None
        if declared and now - stalled.setdefault(node, now) <= node_timeout:
            return None
        stalled.pop(node, None)
        return held, taken

    @staticmethod
    def _taken_by_spare(held: Owner | None, handed_to: str | None, replaced: int) -> bool:
        """Whether ``held``, a node's owner, is a spare this launcher did not hand the node over to (``handed_to``,
        :attr:`_spare_of`): its own supervisors of the node hold the rank as no spare (its first one, its
        replacements) or as the spare handed over, so such an owner took the rank from them. An owner no newer than
        ``replaced``, the one this launcher's replacement of the node takes over from (:attr:`_replaced`; a
        standby's own spare that took the rank and died since, say), took nothing from that replacement."""
        return held is not None and bool(held.spare) and held.spare != handed_to and held.incarnation > replaced

    def _left_to_spare(self, node: int, held: Owner | None, code: int) -> bool:
        """Multi-node: whether a spare took ``node``'s rank (``held``: its owner, just read) from its supervisor,
        which died (``code``) before it saw that (stalled until then, say). The launcher then leaves the job to that
        spare as a supervisor that sees it does (:data:`EXIT_REPLACED`): no node-lost generation, no replacement (it
        would take the rank from the running spare), and the node's files stay where the spare shares this host's
        shared memory (same names)."""
        if not self._taken_by_spare(held, self._spare_of.get(node), self._replaced.get(node, 0)):
            return False
        assert held is not None
        if held.shm and held.shm == shm_place():
            self._kept_files.add(node)
        self.events.emit("replaced", f"leaving the job: node rank {node} was taken by spare {held.spare} (incarnation "
                         f"{held.incarnation}) before its supervisor here was {describe_exit(code)}", node=node,
                         spare=held.spare, exit_code=code)
        return True

    def _files_left_to_spare(self, node: int) -> bool:
        """Whether ``node``'s files on this host are not this launcher's to remove at its end: its supervisor left
        the job to a spare (:data:`EXIT_REPLACED`; it removed them itself unless the spare shares them), or died
        after a spare that shares them took the rank."""
        proc = self.procs.get(node)
        return (proc is not None and proc.poll() == EXIT_REPLACED) or node in self._kept_files

    def _replace(self, node: int, store_host: str, store_port: int, code: int, lost: int) -> None:
        """Start a replacement supervisor for ``node``, whose rank incarnation ``lost`` holds (0: none): in a
        multi-node job it claims the rank from that incarnation (:attr:`NodeSpec.replaces`), in local mode it takes
        it."""
        self.events.emit("node_lost", f"starting a replacement for node {node}", node=node, exit_code=code)
        self._replaced[node] = lost
        spec = self._node_spec(node, store_host, store_port)
        self.procs[node] = self._spawn(replace(spec, replaces=None if self.cfg.local_mode else lost))
        self._spare_of.pop(node, None)

    def _hand_over(self, coord: Coordinator, node: int) -> bool:
        """If one of this launcher's spares took ``node``'s rank, wait for it as that node's supervisor."""
        held = owner(coord, node)[1]
        proc = self.pool.adopt(held.spare) if self.pool is not None and held is not None and held.spare else None
        if proc is None:
            return False
        self.procs[node] = proc
        self._spare_of[node] = held.spare
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

    def _leave_as_spare(self, store: SignedStore, name: str, nnodes: int) -> None:
        """:meth:`_leave` of a standby: as the node whose rank its spare took and held to the end, if it took one
        (node 0's launcher waits for every node's goodbye)."""
        coord = Coordinator(store, self.job_id, -1, nnodes, run=self.job_run)
        for node in range(nnodes):
            held = owner(coord, node)[1]
            if held is not None and held.spare == name:
                coord.node_rank = node
        self._leave(coord)

    def _host_until_the_run_ends(self, coord: Coordinator) -> None:
        """This launcher hosts the c10d control store and a spare took its node's rank (its supervisor died or was
        cut off): the job goes on on this store, which must stay up until the run ends (the launchers that end it
        set ``state``), this launcher is told to stop, or no supervisor has beaten for 3 x ``--node-timeout``
        (the others are gone without a word). Leaving at once took the store, and the job, with it."""
        self.events.emit("store_kept", f"node {coord.node_rank} left the job to a spare; this launcher keeps the "
                         "control store up until the job ends", node=coord.node_rank)
        seen, moved = coord.beats(), time.monotonic()
        while coord.get("state") is None and self.signalled is None:
            time.sleep(_HOST_LOOK)
            beats = coord.beats()
            if beats != seen:
                seen, moved = beats, time.monotonic()
            elif time.monotonic() - moved > 3 * self.cfg.node_timeout:
                return

    def _leave(self, coord: Coordinator, holds_rank: bool = True) -> None:
        """Multi-node: say this node is gone (as the incarnation of its rank that ends here; not when a spare took
        the rank, ``holds_rank`` False: the spare says it); the launcher hosting the control store (node 0's, or
        the one that bound the port first without --node-rank, even as a spare) keeps it up until the other nodes
        have left and no spare is still waiting (it notices the end and says so in the store), for at most
        :data:`_ACK_TIMEOUT` seconds. Invariant: it waits only for what can still answer: not for a node whose
        owner was declared lost and not replaced, or that never had one (nothing of it is left to say goodbye),
        nor for a spare whose record says "waiting" but whose beats stopped for :data:`SPARE_SILENCE` (killed
        while it waited)."""
        if self.cfg.local_mode:
            return
        if coord.node_rank >= 0 and holds_rank:
            held = owner(coord, coord.node_rank)[1]
            coord.mark(0, "left", held.incarnation if held is not None else 0)
        if self.store_server is not None:
            deadline = time.monotonic() + _ACK_TIMEOUT
            waiting, gone = SpareWatch(coord, SPARE_SILENCE), set[int]()
            while (self._staying(coord, gone) or waiting.waiting()) and time.monotonic() < deadline:
                time.sleep(0.05)

    @staticmethod
    def _staying(coord: Coordinator, gone: set[int]) -> list[int]:
        """The nodes whose rank's current owner has not said it left (:meth:`_leave`): not those that never had an
        owner (their launcher never came), nor those whose owner was declared lost. A goodbye of an earlier owner
        (a node's launcher whose rank a spare took) does not count for the spare. ``gone``: nodes seen gone by an
        earlier call, not read again (at the job's end no rank changes hands)."""
        left = coord.marks(0, "left")
        staying = []
        for node in range(coord.nnodes):
            if node in gone:
                continue
            held = owner(coord, node)[1]
            if (held is None or left.get(node) == str(held.incarnation)
                    or coord.get("node", node, "lost") == str(held.incarnation).encode()):
                gone.add(node)
            else:
                staying.append(node)
        return staying


class StartInterrupted(BaseException):
    """A stop signal came before the launcher handles it (its job not started): as KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def _interrupt(signum: int, frame: object) -> None:
    raise StartInterrupted(signum)


def _omp_threads(cfg: JobConfig) -> int:
    """The trainers' OMP_NUM_THREADS unless the user set one: this host's cores shared by its trainers."""
    return default_omp_threads(cfg.nproc_per_node * (cfg.nnodes if cfg.local_mode else 1))


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


def store_hint(cfg: JobConfig) -> str:
    """What to use instead of a control store that went away with a node (nothing in local mode, or with etcd)."""
    if cfg.rdzv_backend == "c10d" and not cfg.local_mode:
        return "; a store that outlives any node: --rdzv-backend etcd, or `ftrun store` on a host of its own"
    return ""


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
        size_blas(trainer_threads(os.environ, _omp_threads(cfg)))  # before the forks
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
