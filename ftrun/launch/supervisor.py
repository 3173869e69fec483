"""The supervisor: one long-lived process per node that runs the node's trainers generation after generation.

Loop (the protocol itself is in :mod:`ftrun.control.coordination`)::

    join (replacement? bump) -> rendezvous(g) -> start trainers -> watch -> stop trainers -> next g | exit

While watching, at every look it reaps children (a crash is seen by waitpid), reads the heartbeat table (hangs),
reads the generation key when told or every 0.25 s (failures seen elsewhere), and four times a second, in the same
round trip, the peers' beat counters (lost nodes) and the hang vote (a peer attributing a hang). A look comes at
once when a trainer or the keeper exits, the generation moves or a stop signal comes (it waits on their pidfds, the
:class:`GenerationWatch` and a :class:`Wakeup` in one ``select``); else every ``--monitor-interval`` (20 ms) while a
moment counts (until a restart's trainers all beat again: its recovery time, if they beat at all; once a trainer has
exited 0: the job's end; while an injected node loss waits for its step), and otherwise when the next check is due:
the store, the peers, the status, a trainer's hang deadline, and eight looks per hang timeout
(:meth:`Supervisor._next_look`). The first failure seen moves the job to the next generation; every node then stops
its trainers and meets the others at the next rendezvous: once the job has a committed snapshot with SIGCONT and
SIGKILL (their state is restored from it, and a handler of a polite signal would hold the restart up for nothing);
else, and when the job stops or fails for good, with SIGCONT, SIGTERM (SIGINT after Ctrl-C, as torchrun) and SIGKILL
after ``stop_grace``.

Beside the trainers runs the node's snapshot keeper (:mod:`ftrun.snapshot.keeper`), started before the first
trainer and kept across generations (:mod:`ftrun.launch.keeper_process`); if it dies it is restarted at once and
the trainers keep running, and so is one that lives but answers nothing (:mod:`ftrun.launch.keeper_watch`: killed
after 3 x ``--node-timeout``, at least 15 s). A
:class:`~ftrun.snapshot.link.KeeperLink` thread agrees each generation's restore step with the other nodes
while the trainers start (they wait for it in ``Snapshotter.restore``). A fatal keeper error (no room in
/dev/shm) ends the job: it becomes a generation of kind "fatal", which every supervisor turns into an exit.
A supervisor told to stop (SIGTERM, SIGINT) stops the whole job the same way, with a generation of kind "stop":
every node stops its trainers, persists the newest step and exits.

A hung trainer's peers block in their next collective and fall silent too; the rank blamed is agreed job-wide
(:meth:`Supervisor._attribute_hang`), so it is the one that stopped first whichever node's timeout fires first.
Likewise a trainer that dies of a broken connection to another node waits for that node's loss to be declared,
if it is lost (:meth:`Supervisor._wait_for_lost_node`). A supervisor checks that it still owns its node rank
before it joins a generation and before it starts trainers: one that was cut off and replaced leaves.

Under srun no ftrun joins a running step: a lost node whose own launcher starts no replacement (it is gone too)
and whose rank no spare takes ends the step (:func:`~ftrun.launch.rendezvous.nothing_replaces`), each node
keeping its snapshots in RAM for the next step, instead of the job waiting out ``--rdzv-timeout`` for a node that
cannot come. A lost supervisor whose ftrun lives (it beats in the control store) was only stalled: the others
wait for it, and its ftrun kills and replaces it if it does not come back. A spare counts only while it beats
(:class:`~ftrun.launch.peers.SpareWatch`): one killed while it waited is none.

Beside this module: the reads of a rendezvous (:mod:`ftrun.launch.rendezvous`), what a failed trainer's reason
and the job's error file say (:mod:`ftrun.launch.root_cause`), node 0's progress report
(:mod:`ftrun.launch.leader_log`), the exceptions that end a run (:mod:`ftrun.launch.supervisor_ends`), this
node's beats (:class:`~ftrun.launch.peers.Beater`) and an earlier run's logs put aside
(:func:`~ftrun.launch.output.keep_earlier_logs`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn, TypeVar

from torch.distributed import DistError, TCPStore

from ftrun.events import EventLog, brief_numbers
from ftrun.control.backend import OutageReport, open_store, reopen_store, spec_address
from ftrun.control.coordination import Coordinator, Failure, Generation, use_job
from ftrun.control.ownership import Owner, claim, owner, take
from ftrun.launch.env import TrainerPlace, trainer_args, trainer_env, trainer_threads
from ftrun.control.faults import Fault, parse_faults, trainer_faults_env
from ftrun.control.heartbeat import Beat, HeartbeatTable
from ftrun.launch.hangs import HangDetector, HangSuspect, culprit, process_state
from ftrun.launch.processes import (SUPERVISOR_NAME, ExitWatch, become_subreaper, describe_exit, die_with_parent,
                                    kill_descendants, kill_left_by_user, left_by_user, oom_kills, reap,
                                    set_process_name, signal_group)
from ftrun.control.spec import (EXIT_DONE, EXIT_JOB_FAILED, EXIT_REPLACED, EXIT_STEP_ENDED, EXIT_STOPPED,
                                EXIT_STOPPED_UNSAVED, FORWARDED_SIGNALS, NodeSpec, STEP_END_KIND, STOP_KIND,
                                run_dir_prefix, safe_job_id, shm_path, shm_place, unlink_node_files)
from ftrun.control.generation_watch import GenerationWatch, Wakeup
from ftrun.control.store import C10dStore, host_store
from ftrun.launch.output import Output, OutputSettings, keep_earlier_logs
from ftrun.launch.peers import BEAT_INTERVAL, Beater, PeerWatch, SpareWatch
from ftrun.launch.spare import Spare
from ftrun.launch.bootstrap import ENV_EARLY_FAILURE
from ftrun.launch.handoff import receive
from ftrun.launch.keeper_ahead import KeeperAhead
from ftrun.launch.keeper_process import KeeperProcess
from ftrun.launch.leader_log import LeaderLog
from ftrun.launch.rendezvous import everyone_ready, not_ready, nothing_replaces
from ftrun.launch import root_cause
from ftrun.launch.root_cause import detail, error_message, first_line, oom_note, peer_error, record_root_cause
from ftrun.launch.supervisor_ends import JobFailed, Replaced, StepEnded
from ftrun.launch.zygote import SpawnRequest, ZygoteClient, size_blas
from ftrun.snapshot.keeper import NODE_LOST_SIGNAL as KEEPER_NODE_LOST, unlink_segments
from ftrun.snapshot.protocol import socket_name
from ftrun.startup import STARTUP_ENVIRON
from ftrun.ui.status import PUBLISH_INTERVAL, NodeStatus, RankStatus, publish

POLL_INTERVAL = 0.02
# A rendezvous polls first after this long, then twice as long each time, up to POLL_INTERVAL: the nodes of a
# restart mark themselves ready within milliseconds of each other, and a long wait (a lost node's replacement)
# still costs the store one read per POLL_INTERVAL.
RDZV_FIRST_POLL = 0.001
# A trainer that exits with an error code right after a peer died is usually a consequence (gloo reports the
# lost connection); it waits this long for the root cause to be reported first. Signals and hangs do not wait.
# An error that names a broken connection (root_cause.PEER_ERRORS) waits longer: until every other node's
# supervisor beats again, or the node timeout (Supervisor._wait_for_lost_node).
SECONDARY_GRACE = 0.15
PEER_CHECK_INTERVAL = 0.25
# seconds between a watching supervisor's reads of the generation that its GenerationWatch did not ask for
GEN_CHECK_INTERVAL = 0.25
# A beating trainer's heartbeat is read at least this often per its hang timeout: its last beat is seen within an
# eighth of the timeout, and a step interval measured across looks (5 x at most an eighth) stays below the floor.
LOOKS_PER_HANG_TIMEOUT = 8
# --monitor-interval above it acts as it: torchrun's agent polls its workers every --monitor-interval (scripts written
# for older torch pass 5), while a supervisor's look also does its checks (the generation, the peers, hang deadlines),
# which a longer pause would delay (a hang at --hang-timeout 2 went unseen for minutes with --monitor-interval 20)
MAX_LOOK_PAUSE = GEN_CHECK_INTERVAL
# An injected node loss at step S whose node's trainers are one step short of S when the generation moves (a failure
# elsewhere: another node's loss injected at S too, whose ranks beat S tens of milliseconds sooner on a loaded host)
# still happens if they reach S within this many seconds: losses injected at one step are one failure, not two
INJECTED_LOSS_WAIT = 1.0
# A hang is attributed job-wide (Supervisor._attribute_hang): every node reports its silent trainers under
# gen/<g>/suspects/<node> once one of them asks (the job-wide ``hang`` key names g, Coordinator.open_hang_vote);
# the asker waits this long for all of them.
HANG_VOTE_WAIT = 1.0
# A crash before the first heartbeat that repeats the one that started the generation (same signature: the
# trainer's "Type: message", or its exit signal or code) ends the job instead of restarting it again.
CRASH_LOOP = "failed the same way twice before its first step; not restarting"


@dataclass
class Trainer:
    local_rank: int
    rank: int
    pid: int
    exit_code: int | None = None


T = TypeVar("T")


def _within_grace(check: Callable[[], T | None]) -> T | None:
    """Poll ``check`` for :data:`SECONDARY_GRACE`; its first non-None answer, or None."""
    deadline = time.monotonic() + SECONDARY_GRACE
    while True:
        found = check()
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(POLL_INTERVAL)


class Supervisor:
    """Runs node ``spec.node_rank``; ``me`` names this process in the rank's owner key. A spare that claimed the
    rank passes its ``incarnation`` and warm ``zygote``; otherwise the supervisor takes the rank at start."""

    def __init__(self, spec: NodeSpec, me: str, secret: str, incarnation: int | None = None,
                 zygote: ZygoteClient | None = None, events: EventLog | None = None,
                 keeper_ahead: KeeperAhead | None = None) -> None:
        self.spec = spec
        self.node = spec.node_rank
        self.me = me
        self.incarnation = incarnation
        self.events = events or EventLog(f"node {self.node}", spec.log_dir)
        self.report = OutageReport(lambda message: self.events.emit("store_outage", message, node=self.node))
        self.faults = parse_faults(spec.faults)
        self.trainers: dict[int, Trainer] = {}
        self.detectors = [HangDetector(spec.hang_timeout_initial, spec.hang_timeout, spec.hang_step_factor)
                          for _ in range(spec.nproc_per_node)]
        self.zygote = zygote
        self.trainer_store: TCPStore | None = None
        self.heartbeats: HeartbeatTable | None = None
        self.gen_watch: GenerationWatch | None = None
        self.exits = ExitWatch()  # the running trainers and the keeper: a look follows each exit at once
        self._signalled = Wakeup()  # set by a stop signal: a look follows it at once
        self.secret = secret
        self.keeper = KeeperProcess(spec, secret, self.events, self.report, self.exits, keeper_ahead)
        self._next_status = 0.0
        self.run_dir = spec.log_dir or tempfile.mkdtemp(prefix=run_dir_prefix(spec.job_id, self.node))
        self._stopping = False
        self._stop_signal = signal.SIGTERM
        self._trainers_started = 0.0  # time.monotonic() when this generation's trainers were started
        self._oom_kills: int | None = None  # the host's count of OOM kills then (None: not counted)
        # (generation, global rank) -> exit code of each trainer this node saw fail (the job error file's errorCode)
        self._exit_codes: dict[tuple[int, int], int] = {}
        # the node's files stay when it ends: a supervisor with this process's /dev/shm took this node's rank (they
        # are its now), or the SLURM step ended (StepEnded: the next step adopts them)
        self._keep_files = False
        self._suspects_sent = -1  # the generation whose silent trainers this node reported
        self.output = Output(OutputSettings(  # where the trainers' stdout/stderr go
            spec.redirects, spec.tee, spec.local_ranks_filter, tuple(spec.duplicate_stdout_filters),
            tuple(spec.duplicate_stderr_filters), spec.label_output), self.run_dir, self.node, spec.role)
        for forwarded in FORWARDED_SIGNALS.values():  # the launcher passes on SIGUSR1/SIGUSR2 (--signals-to-handle)
            signal.signal(forwarded, self._forward_signal)

    # -- life cycle -------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise the node until the job ends; the exit code. The process is a child subreaper (:func:`main`)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(KEEPER_NODE_LOST, lambda *_: self._lose_node("parity-loss (from the keeper)"))
        # SLURM may send these to every process of a step; the launcher forwards them (--signals-to-handle), so
        # here they are not fatal: a handler, not SIG_IGN (as until now), so that a trainer's exec gets its default
        for slurm_warning in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(slurm_warning, lambda *_: None)
        beater: Beater | None = None
        succeeded = False
        try:
            if not self.secret:
                raise JobFailed("no job secret in the environment; start supervisors with the ftrun launcher")
            use_job(self.spec.job_id, self.secret, self._store_warning, run=self.spec.run)
            store = open_store(spec_address(self.spec), self.spec.rdzv_timeout, self.report)
            self.coord = Coordinator(store, self.spec.job_id, self.node, self.spec.nnodes)
            if self.incarnation is None:
                self.incarnation = self._take_rank()
            self.coord.touch_watched_keys()
            beater = Beater(self.spec, self.report)
            beater.start()
            self.gen_watch = self._generation_watch()
            try:
                self.heartbeats = HeartbeatTable(shm_path(self.spec.job_id, self.node, "heartbeat"),
                                                 self.spec.nproc_per_node)
            except PermissionError as err:  # something not ftrun's at its name (see open_shm_file)
                raise JobFailed(f"cannot make the heartbeat table {err.filename}: {err.strerror}") from None
            self.keeper.start()
            what = (f"spare {self.spec.spare}, now the supervisor of node {self.node}," if self.spec.spare
                    else "replacement supervisor" if self.incarnation > 1 else "supervisor")
            self.events.emit("node_start", f"{what} up (pid {os.getpid()}, zygote "
                             f"{'pid ' + str(self.zygote.pid) if self.zygote else 'off'})",
                             node=self.node, incarnation=self.incarnation, pid=os.getpid())
            if self.spec.log_dir and self.incarnation == 1:
                keep_earlier_logs(self.spec.log_dir, self.node, self.spec.nproc_per_node, self.events)
            code = self._generations()
            succeeded = code == EXIT_DONE
            return code
        except JobFailed as err:
            self.events.emit("failed", f"job failed: {err}", node=self.node)
            return EXIT_JOB_FAILED
        except Replaced as err:
            self.events.emit("replaced", f"leaving the job: {err}", node=self.node)
            return EXIT_REPLACED
        except StepEnded as err:
            self.events.emit("step_ended", f"{err}; this node's snapshots stay in its RAM for the next step (an "
                             "`ftrun sbatch-template` script runs it)", node=self.node)
            self._keep_files = True
            return EXIT_STEP_ENDED
        except DistError as err:
            lost = f"control store lost: {str(err).splitlines()[0]}"
            if self.spec.slurm_step and self.spec.rdzv_backend == "c10d":  # node 0's ftrun hosted it: gone
                self.events.emit("step_ended", f"{lost}: node 0's ftrun, which hosts it, is gone, and the SLURM step "
                                 "with it; this node's snapshots stay in its RAM for the next step", node=self.node)
                self._keep_files = True
                return EXIT_STEP_ENDED
            self.events.emit("failed", lost, node=self.node)
            return EXIT_JOB_FAILED
        finally:
            self._stop_trainers()
            if self.zygote is not None:
                self.zygote.close()
            # replaced by a supervisor on this host (this /dev/shm), or the SLURM step ended: the files stay
            self.keeper.stop(unlink=not self._keep_files)
            if beater is not None:
                beater.stop()
            if self.heartbeats is not None:
                self.heartbeats.close(unlink=not self._keep_files)
            self._end_descendants(succeeded)
            if self.spec.log_dir is None:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def _kill_left_running(self, gen: int) -> None:
        """Before a restart: kill what the trainers of generation ``gen`` started and left running outside their
        process groups (a daemon, a server in a session of its own): the next generation starts them again, and
        one left would hold its port or its GPU memory."""
        left = kill_left_by_user()
        if left:
            named = ", ".join(f"{pid} ({name})" for pid, name in left[:5])
            self.events.emit("left_killed", f"killed {len(left)} process(es) the trainers of generation {gen} left "
                             f"running: {named}", node=self.node, pids=[pid for pid, _ in left], generation=gen)

    def _end_descendants(self, succeeded: bool) -> None:
        """Kill what is left under this process: ftrun's own processes always; those the trainers started and
        left running (re-parented here) only if the job did not succeed. After a success they outlive the job,
        as under torchrun (a last upload, started and not waited for)."""
        left = kill_descendants(spare=left_by_user if succeeded else None)
        if left:
            named = ", ".join(f"{pid} ({name})" for pid, name in left[:5])
            self.events.emit("left_running", f"the trainers left {len(left)} process(es) running: {named}; the job "
                             "succeeded, so they outlive it, as under torchrun", node=self.node,
                             pids=[pid for pid, _ in left])

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True
        self._stop_signal = signal.Signals(signum)
        self._signalled.set()

    def _forward_signal(self, signum: int, frame: object) -> None:
        """SIGUSR1/SIGUSR2 the launcher got (as :data:`FORWARDED_SIGNALS`): to every running trainer."""
        original = next(sig for sig, forwarded in FORWARDED_SIGNALS.items() if forwarded == signum)
        for trainer in list(self.trainers.values()):
            if trainer.exit_code is None:
                try:
                    os.kill(trainer.pid, original)
                except ProcessLookupError:
                    pass

    def _store_warning(self, message: str) -> None:
        """A control-store value was ignored (not authentic): one line per key, never a failure."""
        self.events.emit("store_rejected", message, node=self.node)

    # -- generations ------------------------------------------------------------------------------------------
    def _generation_watch(self) -> GenerationWatch | None:
        """A watch of the generation on a store connection of its own; None where the store cannot wait."""
        address = spec_address(self.spec)
        if address.backend != "c10d":
            return None
        store = reopen_store(address, self.spec.rdzv_timeout, self.report)
        assert isinstance(store, C10dStore)
        return GenerationWatch(store, self.coord, self.coord.current().gen)

    def _gen_check_interval(self, done: bool) -> float:
        """How long a watching supervisor may go without reading the generation: the store's poll interval
        (0 for c10d: each look at the trainers) without a working watch, or once this node is done (every node
        done ends the job: no waiting for that); else :data:`GEN_CHECK_INTERVAL`, a move being told at once."""
        if self.gen_watch is None or self.gen_watch.lost or done:
            return self.coord.store.poll_interval
        return GEN_CHECK_INTERVAL

    def _pause(self, until: float) -> None:
        """Until ``until`` (``time.monotonic()``; at least --monitor-interval from now, or :data:`MAX_LOOK_PAUSE` when
        that is less), an exit of a trainer or the keeper, a move of the generation or a stop signal, whichever comes
        first."""
        wakers = [*self.exits.fds(), self._signalled, *([self.gen_watch.moved] if self.gen_watch is not None else [])]
        least = min(self.spec.monitor_interval, MAX_LOOK_PAUSE)
        select.select(wakers, [], [], max(least, until - time.monotonic()))

    def _next_look(self, *checks: float) -> float:
        """When the next look is due, ``checks`` being when the loop's own checks are: the earliest of them, this
        node's next status, the moment a running trainer that does not beat again counts as hung, and
        :data:`LOOKS_PER_HANG_TIMEOUT` looks per hang timeout."""
        armed = [d for t in self.trainers.values() if t.exit_code is None and (d := self.detectors[t.local_rank]).armed]
        now = time.monotonic()
        return min(*checks, self._next_status, *(min(d.deadline, now + d.timeout / LOOKS_PER_HANG_TIMEOUT)
                                                for d in armed))

    def _reap(self) -> dict[int, int]:
        """:func:`reap`, forgetting the reaped children's exit descriptors."""
        done = reap()
        for pid in done:
            self.exits.forget(pid)
        return done

    def _generations(self) -> int:
        seen = self.coord.current_raw()
        if self.incarnation > 1 and self.node in self.coord.marks(Generation.decode(seen).gen, "ready"):
            seen = self._fail(seen, Failure("node-replaced", f"node {self.node} was replaced "
                                            f"(incarnation {self.incarnation})", node=self.node,
                                            detected_by="replacement supervisor"))
        while True:
            gen = Generation.decode(seen)
            if gen.kind == STEP_END_KIND:
                raise StepEnded(gen.reason)
            if gen.kind == STOP_KIND:
                self._publish_status("stopped", gen.gen, now=True)
                return self._stopped()
            if gen.gen > self.spec.max_restarts or gen.kind == "fatal":
                record_root_cause(gen, self.node, self.run_dir, self._exit_codes, self.events)
                raise JobFailed(gen.reason if gen.kind == "fatal" else f"restart limit reached "
                                f"({self.spec.max_restarts} restarts); last failure: {gen.reason}")
            changed = self._rendezvous(gen.gen, seen)
            if changed is not None:
                seen = changed
                continue
            if self._stopping:
                self._ask_stop(seen)
                return self._stopped()
            assert self.keeper.link is not None
            self.keeper.link.begin(gen.gen)
            self._started_by = gen
            self._start_trainers(gen.gen)
            outcome = self._watch(gen, seen)
            self._stop_trainers(self._trainer_stop_signal(outcome))
            if self._restarts(outcome):
                self._kill_left_running(gen.gen)
            if outcome == "done":
                self._publish_status("done", gen.gen, now=True)
                self._persist_final()
                return EXIT_DONE
            if outcome == "stop":
                self._publish_status("stopped", gen.gen, now=True)
                return self._stopped()
            seen = outcome

    def _stopped(self) -> int:
        return EXIT_STOPPED if self._persist_final() else EXIT_STOPPED_UNSAVED

    def _persist_final(self) -> bool:
        """With a checkpoint directory: persist the newest globally committed step before the keeper stops."""
        if self.spec.ckpt_dir is None or self.keeper.link is None:
            return True
        problem = self.keeper.link.finish(self.spec.persist_grace)
        if problem is not None:  # "failed: ..." is the job's outcome, alike on every node: node 0 says it
            self.events.emit("durability", f"WARNING the final persist to {self.spec.ckpt_dir} {problem}",
                             console=self.node == 0 or not problem.startswith("failed"), node=self.node,
                             degraded=True, reason=problem)
        return problem is None

    def _rendezvous(self, gen: int, seen: bytes) -> bytes | None:
        """Meet every node at generation ``gen``; returns the new raw generation if it moved on meanwhile.

        Each node marks itself ready; node 0 waits for every mark and then sets ``gen/<g>/go``, which the others
        wait for: a poll reads N keys on node 0 and one key elsewhere, so the job's rendezvous costs the store
        O(N) keys per poll, not O(N^2)."""
        if self.node == 0:
            self.trainer_store = None  # the previous generation's store closes with its last reference
            self.trainer_store = host_store(0, "trainer store", bind=self.spec.bind_addr)
            self.coord.publish_master(gen, self.spec.master_addr, self.trainer_store.port)
        self._check_owner()
        self.coord.rejoin(self.incarnation)
        self.coord.mark(gen, "ready", self.incarnation)
        deadline = time.monotonic() + self.spec.rdzv_timeout
        # once, after --node-timeout: node 0 says which nodes the job waits for; under srun every node looks for a
        # lost node that nothing will replace, every --node-timeout (whether its ftrun beat since the last look: the
        # first look compares with what is read here)
        tell_at = time.monotonic() + self.spec.node_timeout if self.node == 0 or self.spec.slurm_step else math.inf
        told = False
        launchers = (self.coord.launcher_beats([n for n in range(self.spec.nnodes) if n != self.node])
                     if self.spec.slurm_step else {})
        peers = self._peer_watch()
        next_peer_check = time.monotonic() + PEER_CHECK_INTERVAL
        spare_watch = SpareWatch(self.coord, self.spec.node_timeout)
        pause = RDZV_FIRST_POLL
        while not self._stopping:
            self._publish_status("starting" if gen == 0 else "restarting", gen)
            if everyone_ready(self.coord, gen):
                self._check_owner()  # taken over while it waited: its trainers must not start
                return None
            if time.monotonic() > tell_at:  # a lost node's replacement (or a late node) is awaited
                tell_at = time.monotonic() + self.spec.node_timeout if self.spec.slurm_step else math.inf
                missing = not_ready(self.coord, gen)
                # the spares before the owners: a spare that claims a rank meanwhile has changed its owner
                spare_waits = self.spec.slurm_step and spare_watch.waiting()
                unreplaced = nothing_replaces(self.coord, missing, launchers) if self.spec.slurm_step else None
                if unreplaced is not None and not spare_waits:
                    return self.coord.bump(seen, Failure(
                        STEP_END_KIND, f"node {unreplaced} lost and nothing replaces it (its ftrun is gone, no "
                        "--standby waits that still beats, and no ftrun joins a running SLURM step): ending the "
                        "step", unreplaced, None, f"node {self.node}"))[0]
                if self.node == 0 and not told:
                    told = True
                    self.events.emit("rendezvous_wait", f"generation {gen} waits for node(s) "
                                     f"{brief_numbers(missing)} to join; it gives up {self.spec.rdzv_timeout:g}s "
                                     "after it began (--rdzv-timeout)",
                                     node=self.node, generation=gen, missing=missing)
            now_raw = self.coord.current_raw()
            if now_raw != seen:
                return now_raw
            if self.spec.slurm_step:  # a watch not looked at blames no spare
                spare_watch.keep_up()
            if time.monotonic() >= next_peer_check:
                next_peer_check = time.monotonic() + PEER_CHECK_INTERVAL
                lost = self._check_peers(peers, seen)
                if lost is not None:
                    return lost
            if time.monotonic() > deadline:
                never = (" (started with this job's --rdzv-id and endpoint, and the same secret file? one that "
                         "differs is told so as it starts)" if gen == 0 else "")
                raise JobFailed(f"node(s) {brief_numbers(not_ready(self.coord, gen))} did not join generation {gen} "
                                f"within {self.spec.rdzv_timeout:g}s{never}")
            time.sleep(max(pause, self.coord.store.poll_interval))
            pause = min(2 * pause, POLL_INTERVAL)
        return None

    def _start_trainers(self, gen: int) -> None:
        assert self.heartbeats is not None
        t0 = time.monotonic()
        self._oom_kills = oom_kills()
        master = self.coord.master(gen)
        if master is None:
            raise JobFailed(f"the trainer store of generation {gen} is missing from the control store")
        addr, port = master
        for local in range(self.spec.nproc_per_node):
            place = TrainerPlace(self.spec.job_id, self.node, self.spec.nnodes, local, self.spec.nproc_per_node,
                                 gen, self.spec.max_restarts, addr, port)
            error_file = root_cause.error_file(self.run_dir, gen, place.rank)
            os.makedirs(os.path.dirname(error_file), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # an earlier run's (the trainer may write none)
                os.unlink(error_file)
            env = trainer_env(dict(STARTUP_ENVIRON), place, omp_threads=self.spec.omp_threads,
                              heartbeat_file=self.heartbeats.path,
                              keeper_socket=socket_name(safe_job_id(self.spec.job_id), self.node),
                              error_file=error_file,
                              faults=trainer_faults_env(self.faults, place.rank, gen), role=self.spec.role,
                              signals_to_handle=self.spec.signals_to_handle,
                              virtual_local_rank=self.spec.virtual_local_rank,
                              dcp_root=self.spec.ckpt_dir, node_addr=self.spec.master_addr)
            env.update(_early_failure_env(self._started_by))
            self.heartbeats.reset(local)
            stdio = self.output.open(gen, place.rank, local)  # {} unless --redirects, --tee, ... ask
            try:
                pid = self._spawn(env, stdio, trainer_args(self.spec.args, local))
            finally:
                self.output.spawned(stdio)
            self.trainers[pid] = Trainer(local, place.rank, pid)
            self.exits.watch(pid)
            self.detectors[local].trainer_started(time.monotonic())
        self._trainers_started = time.monotonic()
        took = self._trainers_started - t0
        self.coord.mark(gen, "started", time.time())
        how = "forked by the zygote" if self.zygote else "as new processes"
        self.events.emit("trainers_started", f"generation {gen}: started {len(self.trainers)} trainers {how} "
                         f"in {took * 1000:.0f} ms", node=self.node, generation=gen,
                         pids={t.rank: t.pid for t in self.trainers.values()}, seconds=took)

    def _spawn(self, env: dict[str, str], stdio: dict[int, int], args: list[str]) -> int:
        """Start a trainer with the script's arguments ``args``; ``stdio`` maps 1 (stdout) and 2 (stderr) to the
        descriptors it gets instead of this process's."""
        spec = self.spec
        if self.zygote is not None:
            try:
                return self.zygote.spawn(SpawnRequest(spec.target, args, spec.module, env, spec.cwd,
                                                      stdio=list(stdio)), fds=list(stdio.values()))
            except (OSError, RuntimeError, ValueError) as err:
                self.events.emit("zygote", f"zygote failed ({err}); starting trainers as new processes",
                                 node=self.node)
                self.zygote.close()
                self.zygote = None
        if spec.no_python:
            argv = [spec.target, *args]
        else:
            # `python -u script.py` (or `-m module`), through ftrun's bootstrap: the traceback and error file of a
            # failure are those of a zygote-forked trainer (-P: the user's cwd never shadows ftrun)
            argv = [sys.executable, "-u", "-P", "-m", "ftrun.launch.bootstrap", *(["-m"] if spec.module else []),
                    spec.target, *args]
        supervisor = os.getpid()
        proc = subprocess.Popen(argv, env=env, cwd=spec.cwd, start_new_session=True, stdout=stdio.get(1),
                                stderr=stdio.get(2), preexec_fn=lambda: die_with_parent(supervisor))
        proc.returncode = 0  # reaped by this supervisor's reap(), never by Popen
        return proc.pid

    # -- watching ---------------------------------------------------------------------------------------------
    def _watch(self, gen: Generation, seen: bytes) -> bytes | str:
        """Watch one generation; returns "done", "stop", or the raw document of the next generation."""
        assert self.heartbeats is not None
        g = gen.gen
        node_faults = [f for f in self.faults if f.kind == "node-loss" and f.where == self.node and f.gen == g]
        peers = self._peer_watch()
        next_peer_check = next_gen_check = 0.0
        up = done = exited_0 = False
        leader = LeaderLog(self.coord, self.events, gen) if self.node == 0 else None
        while True:
            if self._stopping:
                return self._ask_stop(seen)
            exited = []  # every exit of the batch is recorded before one is acted on (a return ends the loop)
            for pid, code in self._reap().items():
                if self.keeper.owns(pid):
                    self.keeper.exited(code)
                elif (trainer := self.trainers.get(pid)) is not None:
                    trainer.exit_code = code
                    exited.append(trainer)
            for trainer in exited:
                code = trainer.exit_code
                assert code is not None
                self.output.drain(trainer.rank)  # its last lines before what its exit is reported as
                # SLURM signals every process of a step at once: the trainer heard it first
                if code == -signal.SIGTERM and self._stop_signal_follows():
                    return self._ask_stop(seen)
                if code == 0 and not exited_0:
                    exited_0 = True  # the node's first: a peer's connection error may come of it
                    self.coord.note_exit(g, trainer.rank, self._step_of(trainer))
                if code != 0:
                    self._exit_codes[g, trainer.rank] = code
                    message = error_message(self.run_dir, g, trainer.rank)
                    left = ""
                    if code > 0:
                        moved = self._wait_for_other_failure(seen)
                        if moved is None and peer_error(message):
                            moved = self._wait_for_lost_node(seen, peers)
                            left = self._left_early(g, trainer.rank)
                        if moved is not None:
                            return moved
                    return self._fail(seen, Failure(
                        "crash", f"rank {trainer.rank} {describe_exit(code)}{left}{oom_note(code, self._oom_kills)}"
                        f"{detail(message)}",
                        self.node, trainer.rank, "waitpid", self._step_of(trainer),
                        signature=message or describe_exit(code), early=self._before_first_beat(g)))
            if not done and all(t.exit_code == 0 for t in self.trainers.values()):
                done = True
                next_gen_check = 0.0  # whether every node is done: at once, then at each look
                self.coord.mark(g, "done")
                self.events.emit("node_done", f"all {len(self.trainers)} trainers exited 0", console=False,
                                 node=self.node, generation=g)
            now = time.monotonic()
            table = [self.heartbeats.read(local) for local in range(self.spec.nproc_per_node)]
            hung = [t for t in self.trainers.values()  # every detector sees every beat (no any(): it stops early)
                    if t.exit_code is None and self.detectors[t.local_rank].observe(table[t.local_rank], now)]
            if hung:
                return self._attribute_hang(seen, g, table)
            for fault in node_faults:
                if any(beat.step >= fault.step for beat in table):
                    self._lose_node(fault.spec)
            if not up and all(beat.beats > 0 for beat in table):
                up = True
                self.coord.mark(g, "up", time.time())
            fatal = self.keeper.given_up or (self.keeper.link.fatal if self.keeper.link is not None else None)
            if fatal is not None:
                return self._fail(seen, Failure("fatal", fatal, self.node, None, "keeper"))
            # failures seen elsewhere (told by the watch, or read now and then), with the peers' beats and the hang
            # vote when they are due (one round trip); once this node is done, whether every node is
            watch = self.gen_watch
            peers_due = now >= next_peer_check
            if (watch is not None and watch.moved.is_set()) or now >= next_gen_check or peers_due:
                if watch is not None:
                    watch.moved.clear()  # before the read: a move after it sets it again
                next_gen_check = now + self._gen_check_interval(done)
                if peers_due:
                    now_raw, vote, peer_values = self.coord.look(peers.keys)
                else:
                    now_raw = self.coord.current_raw()
                if now_raw != seen:
                    self._lose_node_before_leaving(node_faults)
                    return now_raw
                if done and self.coord.marked(g, "done") is not None:  # the job is done: leave at once
                    if leader is not None:
                        leader.finish()
                    return "done"
                if peers_due:
                    next_peer_check = now + PEER_CHECK_INTERVAL
                    lost = self._check_peers(peers, seen, peer_values)
                    if lost is not None:
                        return lost
                    if self._suspects_sent != g and self.coord.hang_vote_open(vote, g):
                        self._send_suspects(g, table)  # a peer attributes a hang: report this node's silent trainers
                    if leader is not None:
                        leader.poll()
            self._publish_status("done" if done else "running", g)
            # see the module doc (a script that never beat has no recovery time to wait for)
            eager = (g > 0 and not up and any(d.armed for d in self.detectors)) or exited_0 or bool(node_faults)
            self._pause(now if eager else self._next_look(next_gen_check, next_peer_check))

    def _peer_watch(self) -> PeerWatch:
        assert self.incarnation is not None
        return PeerWatch(self.coord, self.node, self.spec.nnodes, self.spec.node_timeout,
                         Owner(self.incarnation, self.me))

    def _check_peers(self, peers: PeerWatch, seen: bytes, values: list[bytes | None] | None = None) -> bytes | None:
        """One look at the watched peers' beats (``values``: :attr:`PeerWatch.keys` just read): the raw generation
        a lost peer started, or None. Raises :class:`Replaced` when a spare owns this node's rank now."""
        lost = peers.check(values)
        if peers.replaced_by is not None:
            raise self._replaced(peers.replaced_by)
        if lost is None:
            return None
        peer, silent = lost
        held = owner(self.coord, peer)[1]
        return self._fail(seen, Failure("node-lost", f"node {peer} lost: no supervisor beat for {silent:.1f}s",
                                        peer, None, f"node {self.node} (supervisor beats)",
                                        incarnation=held.incarnation if held else None))

    def _take_rank(self) -> int:
        """Take this node's rank; returns this supervisor's incarnation. A replacement of a lost supervisor
        (``spec.replaces``) takes it only from the incarnation that was lost, as a spare claims it: of it and a hot
        spare racing for the rank, one gets it, and this one, when it lost, raises :class:`Replaced` before it
        starts anything (the lost supervisor's files go, unless the spare shares this host's shared memory)."""
        host, shm = socket.gethostname(), shm_place()
        if self.spec.replaces is None:
            return take(self.coord, self.node, self.me, host, shm)
        took = claim(self.coord, self.node, self.spec.replaces, self.me, None, host, shm)
        if took is not None:
            return took
        taker = owner(self.coord, self.node)[1]
        if taker is None:
            raise JobFailed(f"node {self.node}'s owner key holds no authentic owner: its replacement cannot take it")
        replaced = self._replaced(taker)
        if not self._keep_files:
            unlink_node_files(self.spec.job_id, self.node)
        raise replaced

    def _replaced(self, taker: Owner) -> Replaced:
        self._keep_files = bool(taker.shm) and taker.shm == shm_place()
        return Replaced(f"node rank {self.node} was taken by "
                        f"{f'spare {taker.spare}' if taker.spare else 'another supervisor'}"
                        f"{' on ' + taker.host if taker.host else ''} (incarnation {taker.incarnation}) after this "
                        "node was seen as lost")

    def _check_owner(self) -> None:
        """Raise :class:`Replaced` if another supervisor owns this node's rank now: a supervisor that was cut
        off and comes back must not join a generation (its ready mark would overwrite its replacement's, its
        trainers would be a second copy of their ranks)."""
        current = owner(self.coord, self.node)[1]
        if current is not None and current.incarnation > self.incarnation:
            raise self._replaced(current)

    def _send_suspects(self, gen: int, table: list[Beat]) -> list[HangSuspect]:
        """Report this node's silent trainers (silent for half their timeout or more) as hang suspects."""
        self._suspects_sent = gen
        now, now_ns, wall = time.monotonic(), time.monotonic_ns(), time.time()
        suspects = []
        for trainer in self.trainers.values():
            detector, beat = self.detectors[trainer.local_rank], table[trainer.local_rank]
            silent = detector.silence(now)
            if trainer.exit_code is None and detector.suspect(now):
                reason = detector.describe(now)
                last = wall - (now_ns - beat.monotonic_ns) / 1e9 if beat.beats else wall - silent
                suspects.append(HangSuspect(trainer.rank, self.node, process_state(trainer.pid), beat.step, last,
                                            reason))
        self.coord.mark(gen, "suspects", HangSuspect.encode_all(suspects))
        return suspects

    def _attribute_hang(self, seen: bytes, gen: int, table: list[Beat]) -> bytes:
        """A trainer of this node is hung. Its peers, on every node, block in their next collective and fall
        silent too, so the rank to blame is chosen job-wide: every node reports its silent trainers, and the one
        that stopped first (:func:`~ftrun.launch.hangs.culprit`) is the failure. Returns the raw generation
        now current."""
        mine = self._send_suspects(gen, table)  # again if sent before: it holds the hung trainer now
        self.coord.open_hang_vote(gen)
        deadline = time.monotonic() + HANG_VOTE_WAIT
        while True:
            if self.coord.marked(gen, "suspects") is not None or time.monotonic() > deadline:
                break
            now_raw = self.coord.current_raw()
            if now_raw != seen:
                return now_raw
            time.sleep(0.05)
        reports = self.coord.marks(gen, "suspects")  # all of them, or those sent within the wait
        reports.pop(self.node, None)
        suspects = mine + [s for raw in reports.values() for s in HangSuspect.decode_all(raw)]
        chosen = culprit(suspects)
        also = sorted(s.rank for s in suspects if s is not chosen)
        reason = f"rank {chosen.rank} hung: {chosen.describe()}" + (
            f"; also silent, waiting for it: rank(s) {brief_numbers(also)}" if also else "")
        return self._fail(seen, Failure("hang", reason, chosen.node, chosen.rank, "heartbeat",
                                        chosen.step if chosen.step >= 0 else None))

    def _publish_status(self, state: str, gen: int, now: bool = False) -> None:
        """This node's :class:`~ftrun.ui.status.NodeStatus`, every :data:`PUBLISH_INTERVAL` at most (``now``:
        at once, for its last state)."""
        if (time.monotonic() < self._next_status and not now) or self.heartbeats is None:
            return
        self._next_status = time.monotonic() + PUBLISH_INTERVAL
        keeper = self.keeper.link.keeper_status if self.keeper.link is not None else {}
        nproc, wall, ranks = self.spec.nproc_per_node, time.time(), []
        running = {t.local_rank: t.pid for t in self.trainers.values() if t.exit_code is None}
        for local in range(nproc):
            beat = self.heartbeats.read(local)
            last = keeper["ranks"][local] if keeper.get("ranks") else {}
            ranks.append(RankStatus(
                rank=self.node * nproc + local, pid=running.get(local), step=beat.step if beat.step >= 0 else None,
                beat_age=(time.monotonic_ns() - beat.monotonic_ns) / 1e9 if beat.beats else None,
                timeout=self.detectors[local].timeout, steps_per_s=self.detectors[local].steps_per_second,
                snapshot_step=last.get("step"), snapshot_age=wall - last["time"] if last else None,
                snapshot_bytes=last.get("bytes", 0), copy_gbs=last.get("copy_gbs")))
        group = self.node // self.spec.ec_group if self.spec.ec_parity else None
        if self.keeper.link is not None and self.keeper.link.rebuilding:
            state = "rebuilding"
        publish(self.coord, NodeStatus(self.node, wall, state, gen, self.incarnation, group,
                                       keeper.get("shm_bytes", 0), keeper.get("committed", 0), ranks))

    def _step_of(self, trainer: Trainer) -> int | None:
        """The last step ``trainer`` reported in its heartbeat (None before its first)."""
        assert self.heartbeats is not None
        step = self.heartbeats.read(trainer.local_rank).step
        return None if step < 0 else step

    def _stop_signal_follows(self) -> bool:
        """Whether this supervisor is (within :data:`SECONDARY_GRACE`) told to stop too."""
        return _within_grace(lambda: self._stopping or None) is not None

    def _wait_for_lost_node(self, seen: bytes, peers: PeerWatch) -> bytes | None:
        """A trainer died of a broken connection to another node (:func:`~ftrun.launch.root_cause.peer_error`). If
        that node was lost whole, its supervisor with it, the node's watchers declare it within ``--node-timeout``:
        that is the failure to report, not this crash, and one generation replaces the node. Waits until the
        generation moves (returns its raw document), every other node's supervisor has beaten since (none is lost:
        None, the crash is reported) or the node timeout has passed (None)."""
        others = [n for n in range(self.spec.nnodes) if n != self.node]
        before = self.coord.beats(others)
        deadline = time.monotonic() + self.spec.node_timeout + PEER_CHECK_INTERVAL
        while time.monotonic() < deadline:
            raw = self.coord.current_raw()
            if raw != seen:
                return raw
            if (lost := self._check_peers(peers, seen)) is not None:
                return lost
            if all(now != then for now, then in zip(self.coord.beats(others), before)):
                return None
            time.sleep(BEAT_INTERVAL / 2)
        return None

    def _wait_for_other_failure(self, seen: bytes) -> bytes | None:
        """Give a root cause seen elsewhere :data:`SECONDARY_GRACE` to move the generation first."""
        return _within_grace(lambda: raw if (raw := self.coord.current_raw()) != seen else None)

    def _left_early(self, gen: int, rank: int) -> str:
        """For a trainer whose peer's end of a connection failed: that another rank had exited 0 before (a rank
        whose data ran out leaves its peers waiting in a collective), or ""."""
        first = self.coord.first_exit(gen)
        if first is None or first[0] == rank:
            return ""
        at = f" at step {first[1]}" if first[1] is not None else ""
        return f" after rank {first[0]} had exited 0{at}"

    def _before_first_beat(self, gen: int) -> bool:
        """Whether no trainer of generation ``gen`` has sent its first heartbeat: none of this node's (its
        heartbeat table), and no other node has all of its trainers beating (their ``up`` marks). A script that
        has never beaten (an unmodified torchrun script) cannot tell its steps: its trainers count as started
        once they ran for ``--hang-timeout-initial`` seconds, the time a trainer is given to start."""
        assert self.heartbeats is not None
        if any(self.heartbeats.read(local).beats > 0 for local in range(self.spec.nproc_per_node)):
            return False
        if (not any(detector.armed for detector in self.detectors)
                and time.monotonic() - self._trainers_started >= self.spec.hang_timeout_initial):
            return False
        return not self.coord.marks(gen, "up")

    def _crash_loop(self, seen: bytes, failure: Failure) -> Failure:
        """``failure`` as it is reported: a crash that repeats the one that started this generation, before the
        first heartbeat or at the same step, or a hang of the same rank at the same step
        (:meth:`Generation.repeated_by`), ends the job with one clear reason
        instead of restarting; when the restart limit ends it anyway, it is reported as usual."""
        cause = Generation.decode(seen)
        if not cause.repeated_by(failure) or cause.gen + 1 > self.spec.max_restarts:
            return failure
        if failure.kind == "hang":
            return replace(failure, kind="fatal", reason=f"hung twice at step {failure.step}; not restarting (a step "
                           f"that legitimately takes this long needs a larger --hang-timeout): {failure.reason}")
        how = CRASH_LOOP if failure.early else f"failed the same way twice at step {failure.step}; not restarting"
        return replace(failure, kind="fatal", reason=f"{how}: {first_line(failure.signature)}")

    def _fail(self, seen: bytes, failure: Failure) -> bytes:
        """Report a failure: try to start the next generation with it; returns the raw generation now current."""
        failure = self._crash_loop(seen, failure)
        raw, won = self.coord.bump(seen, failure)
        new = Generation.decode(raw)
        fields = {"node": failure.node, "rank": failure.rank, "kind": failure.kind,
                  "detected_by": failure.detected_by, "generation": new.gen, "step": failure.step,
                  "signature": failure.signature, "early": failure.early}
        if won:
            at = f" at step {failure.step}" if failure.step is not None else ""
            self.events.emit("failure", f"failure: {failure.reason}{at} (seen by {failure.detected_by})", **fields)
            if new.gen > self.spec.max_restarts and failure.kind != "fatal":
                self.events.emit("generation", f"generation {new.gen}: not started, the restart limit "
                                 f"(--max-restarts {self.spec.max_restarts}) is reached", generation=new.gen,
                                 reason=failure.reason)
            elif failure.kind != "fatal":
                self.events.emit("generation", f"generation {new.gen}: restarting every node's trainers",
                                 generation=new.gen, reason=failure.reason)
        else:
            self.events.emit("failure", f"also seen: {failure.reason}", console=False, primary=False, **fields)
        return raw

    def _ask_stop(self, seen: bytes) -> str:
        """This supervisor was told to stop (SIGTERM, SIGINT): move the job to a generation of kind "stop" (unless
        one is current), so every node stops its trainers, persists the newest step and exits. Returns "stop"."""
        name = self._stop_signal.name
        failure = Failure(STOP_KIND, f"node {self.node}'s supervisor got {name}", self.node, None, name)
        for _ in range(100):  # the generation can move meanwhile (a failure seen elsewhere): ask again after it
            if Generation.decode(seen).kind == STOP_KIND:
                break
            seen, won = self.coord.bump(seen, failure)
            if won:
                self.events.emit("stop", f"{failure.reason}: every node stops its trainers"
                                 f"{' and persists the newest step' if self.spec.ckpt_dir else ''}",
                                 node=self.node, generation=Generation.decode(seen).gen, signal=name)
                break
        return "stop"

    def _lose_node_before_leaving(self, faults: list[Fault]) -> None:
        """Before this node follows a moved generation: a node loss injected in it (``faults``) whose step the
        trainers are one short of happens when they reach it within :data:`INJECTED_LOSS_WAIT` seconds."""
        assert self.heartbeats is not None
        deadline = time.monotonic() + INJECTED_LOSS_WAIT
        for fault in faults:
            while time.monotonic() < deadline:
                reached = max(self.heartbeats.read(local).step for local in range(self.spec.nproc_per_node))
                if reached >= fault.step:
                    self._lose_node(fault.spec)
                if reached < fault.step - 1:
                    break
                time.sleep(min(self.spec.monitor_interval, MAX_LOOK_PAUSE))

    def _lose_node(self, spec: str) -> None:
        """Injected node loss: SIGKILL every process of this node, supervisor included, and unlink its segments."""
        self.events.emit("inject", f"injected {spec}: killing every process of node {self.node}", node=self.node)
        if self.heartbeats is not None:
            self.heartbeats.close()
        for trainer in self.trainers.values():
            signal_group(trainer.pid, signal.SIGKILL)
        if self.zygote is not None:
            os.kill(self.zygote.pid, signal.SIGKILL)
        self.keeper.kill()
        unlink_segments(self.spec.job_id, self.node)
        os.kill(os.getpid(), signal.SIGKILL)

    def _trainer_stop_signal(self, outcome: bytes | str) -> signal.Signals:
        """What stops the trainers after a generation that ended in ``outcome`` (see :meth:`_watch`): SIGKILL for
        a restart once the job has a committed snapshot (the next generation restores their state from it: a
        handler of a polite signal would only hold the restart up); the job's stop signal when it was told to stop
        by SIGINT (Ctrl-C), as torchrun relays it, so that scripts see KeyboardInterrupt (their ``finally``
        blocks, a framework's graceful shutdown); else SIGTERM: at the end of a failed job, and at a restart
        before any snapshot (a script's own checkpoint on SIGTERM may be all it resumes from)."""
        if outcome == "stop":
            return signal.SIGINT if self._stop_signal == signal.SIGINT else signal.SIGTERM
        if self._restarts(outcome):
            snapshot = self.keeper.link is not None and self.keeper.link.progress.known.committed > 0
            return signal.SIGKILL if snapshot else signal.SIGTERM
        if isinstance(outcome, bytes):
            new = Generation.decode(outcome)
            if new.kind == STOP_KIND and new.detected_by == signal.SIGINT.name:
                return signal.SIGINT
        return signal.SIGTERM

    def _restarts(self, outcome: bytes | str) -> bool:
        """Whether a generation that ended in ``outcome`` (see :meth:`_watch`) is followed by another of this
        job: a failure's, neither fatal nor past --max-restarts (not a stop, not the job's end)."""
        if not isinstance(outcome, bytes):
            return False
        new = Generation.decode(outcome)
        return new.kind not in (STOP_KIND, "fatal") and new.gen <= self.spec.max_restarts

    def _stop_trainers(self, stop: signal.Signals = signal.SIGTERM) -> None:
        """Stop every trainer of this node: SIGCONT and ``stop``, then SIGKILL after the grace; reap them all."""
        if not self.trainers:
            return
        t0 = time.monotonic()
        running = [t for t in self.trainers.values() if t.exit_code is None]
        for trainer in running:
            signal_group(trainer.pid, signal.SIGCONT)
            signal_group(trainer.pid, stop)
        deadline = t0 + self.spec.stop_grace
        killed = stop == signal.SIGKILL
        while any(t.exit_code is None for t in running):
            if not killed and time.monotonic() > deadline:
                killed = True
                for trainer in running:
                    signal_group(trainer.pid, signal.SIGKILL)
            for pid, code in self._reap().items():
                if pid in self.trainers:
                    self.trainers[pid].exit_code = code
                elif self.keeper.owns(pid) and not self._stopping:
                    self.keeper.exited(code)
            if killed:  # one already reaped, its code lost, must not hold the stop up forever
                for trainer in running:
                    if trainer.exit_code is None and not _exists(trainer.pid):
                        trainer.exit_code = -signal.SIGKILL
            select.select(self.exits.fds(), [], [], 0.005)  # until one exits, or 5 ms
        for trainer in self.trainers.values():
            if trainer in running or trainer.exit_code != 0:  # what a failed or stopped trainer left in its group
                signal_group(trainer.pid, signal.SIGKILL)  # (one that exited 0: see _end_descendants)
        self.output.finish()  # their last output written out, this generation's files closed
        took = time.monotonic() - t0
        how = " (killed)" if stop == signal.SIGKILL else " (SIGKILL after grace)" if killed else ""
        self.events.emit("stopped", f"stopped {len(running)} trainers in {took * 1000:.0f} ms{how}", console=False,
                         node=self.node, seconds=took, sigkill=killed)
        for pid in self.trainers:
            self.exits.forget(pid)  # reaped, or killed and left to the next reap
        self.trainers.clear()


def _early_failure_env(started_by: Generation) -> dict[str, str]:
    """For the trainers of a generation started by a crash before the first heartbeat: that crash, so that a
    trainer failing the same way prints one line instead of the same traceback again (see
    :mod:`ftrun.launch.bootstrap`)."""
    if started_by.kind != "crash" or not started_by.early:
        return {}
    return {ENV_EARLY_FAILURE: json.dumps({"generation": started_by.gen - 1, "signature": started_by.signature})}


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process, a zombie included."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _run_spare(spec: NodeSpec, me: str, secret: str, zygote: ZygoteClient | None, keeper: KeeperAhead) -> int:
    """A hot spare: wait with a warm zygote and a keeper started ahead for a lost node, then supervise the node
    rank it claimed. Unused, it exits :data:`EXIT_DONE` only when the run's end was read from the control store
    (recorded there before the store's host closes it, which waits for the spares still waiting to see it); a
    control store lost before that is the job's failure, as for its nodes: :data:`EXIT_JOB_FAILED`, or under
    srun with a c10d store (node 0's ftrun gone, the step with it) :data:`EXIT_STEP_ENDED`."""
    events = EventLog(f"spare {spec.spare}", spec.log_dir)
    code = EXIT_DONE
    try:
        use_job(spec.job_id, secret, lambda message: events.emit("store_rejected", message), run=spec.run)
        report = OutageReport(lambda message: events.emit("store_outage", message))
        coord = Coordinator(open_store(spec_address(spec), spec.rdzv_timeout, report), spec.job_id, -1, spec.nnodes)
        claimed = Spare(spec, coord, events, me).wait(zygote)
    except DistError as err:
        code = EXIT_STEP_ENDED if spec.slurm_step and spec.rdzv_backend == "c10d" else EXIT_JOB_FAILED
        events.emit("failed", f"control store lost: {str(err).splitlines()[0]}; the job's end was never "
                    "recorded there: this spare ends as the job's nodes do")
        claimed = None
    if claimed is None:
        if zygote is not None:
            zygote.close()
        keeper.close()
        return code
    node_spec = replace(spec, node_rank=claimed.node)
    events = EventLog(f"node {claimed.node}", spec.log_dir)
    return Supervisor(node_spec, me, secret, claimed.incarnation, zygote, events, keeper).run()


def main(handoff: int | None = None) -> NoReturn:
    """Run a supervisor: a fork of the launcher that reads its spec from ``handoff``, or (None) a new interpreter
    started by :func:`ftrun.launch.handoff.start`. Exits the process."""
    set_process_name(SUPERVISOR_NAME)
    handed = receive(handoff)  # waits for the launcher to have the control store up
    if handed is None:  # the launcher stopped before it needed this node
        os._exit(0)
    spec, secret = handed
    # the zygote first, before any thread or connection of this process: the trainers are forks of it, which it
    # makes ahead and which are re-parented to this process at once (a spare's too)
    become_subreaper()
    zygote = None
    if spec.zygote and not spec.no_python:
        size_blas(trainer_threads(os.environ, spec.omp_threads))  # where the launcher did not (a new interpreter)
        zygote = ZygoteClient(ready=spec.nproc_per_node)
    keeper = KeeperAhead()  # after the zygote's fork: the zygote and trainers hold nothing of it
    me = uuid.uuid4().hex[:12]
    # each has stopped and reaped everything it started
    code = (_run_spare(spec, me, secret, zygote, keeper) if spec.spare
            else Supervisor(spec, me, secret, zygote=zygote, keeper_ahead=keeper).run())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips tearing down torch at interpreter exit (about 0.5 s, with nothing left to do)


if __name__ == "__main__":
    main()
