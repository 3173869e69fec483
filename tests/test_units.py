"""Unit tests of the pieces that need no running job: config, fault specs, heartbeat table, hang detection, the
supervisor's wake-ups."""

from __future__ import annotations

import dataclasses
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftrun.launch.config import JobConfig, build_config, load_yaml
from ftrun.errors import UsageError
from ftrun.control.faults import Fault, decode_trainer_faults, parse_fault, trainer_faults_env
from ftrun.control.heartbeat import PHASE_EXITING, PHASE_RESTORED, Beat, HeartbeatTable, HeartbeatWriter
from ftrun.control.generation_watch import Wakeup
from ftrun.launch.hangs import HangDetector
from ftrun.launch.processes import ExitWatch, reap

ROOT = Path(__file__).resolve().parent.parent


def test_default_yaml_documents_every_setting_with_its_default():
    documented = load_yaml(ROOT / "configs" / "default.yaml")
    defaults = dataclasses.asdict(JobConfig())
    assert documented == defaults


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("nnodes: 3\nnproc-per-node: 4\nhang_timeout: 7\n")
    cfg = build_config(str(config), {"nnodes": 2, "nproc_per_node": None})
    assert (cfg.nnodes, cfg.nproc_per_node, cfg.hang_timeout, cfg.max_restarts) == (2, 4, 7.0, 10)


def test_a_home_directory_path_is_expanded_as_the_shell_would(tmp_path, monkeypatch):
    """``log_dir: ~/logs`` in YAML (or ``--ckpt-dir=~/ckpt``, which bash leaves alone) made a directory named
    ``~`` in the current directory; --secret-file's ``~`` was expanded already."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "c.yaml"
    config.write_text("log_dir: ~/logs\nckpt_dir: ~/ckpt\n")
    cfg = build_config(str(config), {})
    assert (cfg.log_dir, cfg.ckpt_dir) == (str(tmp_path / "logs"), str(tmp_path / "ckpt"))
    assert build_config(None, {"log_dir": "a/~"}).log_dir == "a/~"  # only a leading ~ is the home directory


def test_config_consistency_checks():
    with pytest.raises(UsageError, match="needs --rdzv-endpoint"):
        build_config(None, {"standby": True})
    # as torchrun's static rendezvous: --node-rank alone means the store at --master-addr:--master-port
    assert build_config(None, {"nnodes": 2, "node_rank": 1}).rdzv_endpoint == "127.0.0.1:29500"
    with pytest.raises(UsageError, match="-m and --no-python"):
        build_config(None, {"module": True, "no_python": True})


@pytest.mark.parametrize("key, value, fragment", [
    ("keep", 10**30, "--keep must be an integer from 1 to 2147483647, got 1000000000000000000000000000000"),
    ("persist_every", 10**30, "--persist-every must be an integer from 1 to 2147483647"),
    ("max_restarts", 2**63, "--max-restarts must be an integer from 0 to 2147483647"),
    ("keep", 0, "--keep must be an integer from 1"),
    ("persist_every", -1, "--persist-every must be an integer from 1"),
    ("max_restarts", -1, "--max-restarts must be an integer from 0"),
])
def test_counts_out_of_their_bounds_are_refused_naming_the_setting(key, value, fragment):
    """--keep and --persist-every of 10**30 (or --max-restarts of 2**63) passed validation: each count now has a
    documented bound, and a value outside it is one line naming the flag (the same for the YAML key)."""
    with pytest.raises(UsageError, match=re.escape(fragment)):
        build_config(None, {key: value}, env={})
    assert getattr(build_config(None, {key: 2**31 - 1}, env={}), key) == 2**31 - 1


def test_fault_specs_parse_with_generation_default_zero():
    assert parse_fault("crash@rank=1,step=30") == Fault("crash", 1, 30, 0)
    assert parse_fault("hang@rank=0,step=5,gen=2") == Fault("hang", 0, 5, 2)
    assert parse_fault("node-loss@node=1,step=50").spec == "node-loss@node=1,step=50,gen=0"


def test_trainer_faults_reach_only_their_rank_and_generation():
    faults = [Fault("crash", 1, 30), Fault("hang", 1, 40, 1), Fault("node-loss", 1, 10)]
    assert decode_trainer_faults(trainer_faults_env(faults, rank=1, gen=0)) == [("crash", 30)]
    assert decode_trainer_faults(trainer_faults_env(faults, rank=1, gen=1)) == [("hang", 40)]
    assert trainer_faults_env(faults, rank=0, gen=0) == ""


@pytest.fixture
def table(tmp_path):
    table = HeartbeatTable(str(tmp_path / "hb"), slots=2)
    for slot in range(2):
        table.reset(slot)
    yield table
    table.close()


def test_heartbeat_table_round_trip_and_mode(table, monkeypatch):
    assert os.stat(table.path).st_mode & 0o777 == 0o600
    writer = HeartbeatWriter(table.path, slot=1, generation=3, faults=[])
    writer.beat(7)
    writer.beat()
    beat = table.read(1)
    assert (beat.pid, beat.step, beat.beats, beat.generation) == (os.getpid(), 7, 2, 3)
    assert table.read(0).beats == 0


def test_a_step_the_heartbeat_slot_cannot_hold_is_refused_and_the_slot_keeps_the_last(table):
    """``snap.save(2**63)`` (or ``ftrun.heartbeat(1.5)``) failed in struct.pack with "argument out of range", and
    the bad step, already stored, made the exit's last beat (atexit) fail with a traceback of ftrun's own."""
    writer = HeartbeatWriter(table.path, slot=0, generation=0, faults=[])
    writer.beat(5)
    with pytest.raises(ValueError, match="step 9223372036854775808 is out of range: a step is a signed 64-bit"):
        writer.beat(2**63)
    with pytest.raises(TypeError):
        writer.beat(1.5)  # type: ignore[arg-type]
    writer.exiting()  # what atexit runs
    assert (table.read(0).step, table.read(0).beats) == (5, 2)


def test_injected_crash_fires_at_its_step(table):
    code = ("import sys; from ftrun.control.heartbeat import HeartbeatWriter as W; "
            f"w = W({table.path!r}, 0, 0, [('crash', 3)]); [w.beat(s) for s in range(10)]; print('survived')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == -9 and "survived" not in result.stdout
    assert table.read(0).step == 3


def beat(beats: int, step: int, seconds: float, phase: int = 0) -> Beat:
    return Beat(1, step, beats, int(seconds * 1e9), 0, phase)


def test_hang_detector_is_not_armed_before_any_beat():
    detector = HangDetector(initial=10, floor=2, factor=5)
    detector.trainer_started(0.0)
    assert detector.observe(beat(0, -1, 0), now=1000.0) is None


def test_hang_detector_adapts_to_slow_steps_with_a_floor():
    detector = HangDetector(initial=10, floor=2, factor=5)
    detector.trainer_started(0.0)
    for i in range(1, 5):
        assert detector.observe(beat(i, i, i * 0.1), now=i * 0.1) is None
    assert detector.timeout == 2  # 5 x 0.1 s is below the floor
    assert detector.observe(beat(4, 4, 0.4), now=2.3) is None
    assert "no heartbeat for 2.0s" in detector.observe(beat(4, 4, 0.4), now=2.41)
    detector.observe(beat(5, 5, 1.4), now=2.5)  # a 1 s step: now 5 s are allowed
    assert detector.timeout == pytest.approx(5.0)
    assert detector.observe(beat(5, 5, 1.4), now=7.4) is None


def test_hang_detector_counts_the_steps_between_two_looks():
    """A trainer faster than the supervisor's looks advances several steps between two of them: steps/s counts
    the steps, not the looks (100 steps/s seen every 0.1 s is 100, not 10)."""
    detector = HangDetector(initial=10, floor=2, factor=5)
    detector.trainer_started(0.0)
    for i in range(1, 8):
        detector.observe(beat(i, 10 * i, i * 0.1), now=i * 0.1)
    assert detector.steps_per_second == pytest.approx(100.0)


def test_hang_detector_uses_initial_timeout_after_restart_and_while_exiting():
    detector = HangDetector(initial=10, floor=2, factor=5)
    detector.trainer_started(0.0)
    for i in range(1, 4):
        detector.observe(beat(i, i, i * 0.1), now=i * 0.1)
    detector.trainer_started(100.0)  # a restart: armed, waiting for the first beat
    assert detector.observe(beat(0, -1, 0), now=109.0) is None
    assert "no first heartbeat" in detector.observe(beat(0, -1, 0), now=110.5)
    detector.trainer_started(200.0)
    detector.observe(beat(1, 5, 200.0), now=200.0)
    detector.observe(beat(2, 5, 201.0, PHASE_EXITING), now=201.0)
    assert detector.observe(beat(2, 5, 201.0, PHASE_EXITING), now=209.0) is None


def test_hang_detector_gives_the_first_step_after_a_restore_the_initial_timeout():
    """A restored trainer beats at its restore, then compiles and warms up again in its first step, as the job's
    first step did: that step had only the step timeout (here 2 s, from the intervals of the generation before),
    and a torch.compile longer than it was a hang at every restore, until the job failed for good."""
    detector = HangDetector(initial=10, floor=2, factor=5)
    detector.trainer_started(0.0)
    for i in range(1, 4):
        detector.observe(beat(i, i, i * 0.1), now=i * 0.1)
    detector.trainer_started(100.0)
    detector.observe(beat(1, 2, 100.0, PHASE_RESTORED), now=100.0)
    assert detector.timeout == 10 and detector.observe(beat(1, 2, 100.0, PHASE_RESTORED), now=109.0) is None
    assert "no heartbeat since its restore for 10.5s" in detector.observe(beat(1, 2, 100.0, PHASE_RESTORED), now=110.5)
    detector.observe(beat(2, 3, 111.0), now=111.0)  # its first step done, not a step interval: the floor again
    assert detector.timeout == 2 and "no heartbeat for 2.5s" in detector.observe(beat(2, 3, 111.0), now=113.5)


def test_a_trainer_stopped_at_its_first_steps_is_a_hang_suspect():
    """Seen beating once (no step interval yet: its timeout is ``initial``), then silent: when a peer blocked on
    it times out after the floor, it is a suspect by the floor, not left out (the peer would be blamed)."""
    detector = HangDetector(initial=10, floor=2, factor=5)
    detector.trainer_started(0.0)
    detector.observe(beat(1, 1, 0.1), now=0.1)
    assert detector.timeout == 10 and not detector.suspect(now=1.0)
    assert detector.suspect(now=1.2)  # silent for half the floor
    detector.observe(beat(2, 2, 0.2), now=1.3)  # a step interval (0.1 s: the floor applies)
    assert not detector.suspect(now=2.2) and detector.suspect(now=2.4)
    detector.trainer_started(10.0)  # a restart: before its first beat only ``initial`` counts
    assert not detector.suspect(now=13.0) and detector.suspect(now=15.0)


def test_cli_help_lists_torchrun_flags():
    result = subprocess.run([sys.executable, "-m", "ftrun", "run", "--help"], capture_output=True, text=True,
                            timeout=30)
    for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
                 "--standalone", "-m", "--no-python", "--log-dir", "--config", "--hang-timeout", "--inject"):
        assert flag in result.stdout



def test_multi_node_secret_is_derived_from_a_private_file_and_the_job(tmp_path):
    from ftrun.errors import UsageError
    from ftrun.control.secret import shared_secret

    path = tmp_path / "dir" / "secret"
    first = shared_secret("job-a", str(path))
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(path.read_bytes()) == 32
    assert shared_secret("job-a", str(path)) == first and shared_secret("job-b", str(path)) != first
    path.chmod(0o644)
    with pytest.raises(UsageError, match="accessible by other users"):
        shared_secret("job-a", str(path))


def test_local_jobs_must_fit_this_host_cores_and_memory():
    from ftrun.launch.capacity import NODE_BYTES, TRAINER_BYTES, Host, local_fit_problem, needed_memory

    roomy = Host(cores=2, memory=64 << 30)
    assert local_fit_problem(2, 2, roomy) is None and local_fit_problem(4, 2, roomy) is None  # 4 per core
    assert needed_memory(2, 3) == 2 * NODE_BYTES + 6 * TRAINER_BYTES
    cores = local_fit_problem(4, 8, roomy)  # a torchrun command without --node-rank
    assert cores is not None and "\n" not in cores
    for fragment in ("4 node(s) and 32 trainer(s)", "2 core(s) (at most 8 trainers", "--node-rank N (0..3)",
                     "--rdzv-endpoint HOST:PORT", "srun"):
        assert fragment in cores, cores
    tight = Host(cores=64, memory=needed_memory(2, 2) - 1)
    memory = local_fit_problem(2, 2, tight)
    assert memory is not None and f"at least {needed_memory(2, 2) / (1 << 30):.1f} GiB" in memory
    assert local_fit_problem(2, 2, Host(cores=64, memory=needed_memory(2, 2))) is None
    one_node = local_fit_problem(1, 9, roomy)
    assert one_node is not None and "fewer trainers with --nproc-per-node" in one_node
    assert "EiB" in (local_fit_problem(100000, 100000, roomy) or "")


def test_a_node_of_a_multi_node_job_must_fit_this_host_memory_not_its_cores():
    """A node of a multi-node job (--node-rank, a standby, an srun task) forked up to 1024 trainers with no check:
    now its memory floor is checked as a local job's is, but not its cores (an srun task may have 1 CPU for 8
    GPU trainers)."""
    from ftrun.launch.capacity import Host, needed_memory, node_fit_problem

    assert node_fit_problem(8, Host(cores=1, memory=needed_memory(1, 8))) is None
    short = node_fit_problem(8, Host(cores=64, memory=needed_memory(1, 8) - 1))
    assert short is not None and "\n" not in short, short
    for fragment in ("--nproc-per-node 8: this node and its 8 trainer(s) need at least 2.3 GiB", "fewer trainers"):
        assert fragment in short, short


def test_the_memory_left_is_the_least_of_the_cgroup_limits_up_from_this_process_s_own(tmp_path):
    """Only the root's memory.max was read: under srun (cgroup v2, no cgroup namespace) the step's limit (--mem)
    is on the job's or step's cgroup below the root, so a node's fit was checked against the host's memory."""
    from ftrun.launch.capacity import cgroup_memory_left

    def limit(path: str, maximum: str, current: int) -> None:
        (tmp_path / path).mkdir(parents=True, exist_ok=True)
        (tmp_path / path / "memory.max").write_text(maximum + "\n")
        (tmp_path / path / "memory.current").write_text(f"{current}\n")

    own = "/system.slice/slurmstepd.scope/job_7/step_0"
    assert cgroup_memory_left(str(tmp_path), own) is None
    limit("system.slice", "max", 5)
    limit("system.slice/slurmstepd.scope/job_7", str(8 << 30), 3 << 30)  # the job's --mem
    limit("system.slice/slurmstepd.scope/job_7/step_0", str(16 << 30), 1 << 30)
    assert cgroup_memory_left(str(tmp_path), own) == 5 << 30
    limit("", str(4 << 30), 0)  # a container's own limit, seen at its root
    assert cgroup_memory_left(str(tmp_path), own) == 4 << 30
    assert cgroup_memory_left(str(tmp_path), "/../../elsewhere") == 4 << 30  # never above the root


def test_local_hot_spares_must_fit_this_host_memory():
    """``--spares K`` forked K supervisors (each with a zygote and a keeper) before any check: a typo of K forked
    processes until the host ran out of them. Each spare counts as a node without trainers."""
    from ftrun.launch.capacity import NODE_BYTES, Host, local_fit_problem, needed_memory

    assert needed_memory(2, 2, spares=3) == needed_memory(2, 2) + 3 * NODE_BYTES
    host = Host(cores=2, memory=needed_memory(2, 2, spares=1))
    assert local_fit_problem(2, 2, host, spares=1) is None
    spares = local_fit_problem(2, 2, host, spares=2)
    assert spares is not None and "\n" not in spares
    for fragment in ("--spares 2: 2 node(s), 2 spare(s) and 4 trainer(s)", "give fewer spares with --spares"):
        assert fragment in spares, spares
    assert "EiB" in (local_fit_problem(1, 1, Host(cores=2, memory=64 << 30), spares=99999999999) or "")


def test_the_hang_culprit_is_the_rank_that_stopped_first_not_a_peer_waiting_for_it():
    from ftrun.launch.hangs import BUSY, STOPPED, WAITING, HangSuspect, culprit

    def suspect(rank: int, state: int, step: int = 20, last_beat: float = 100.0) -> HangSuspect:
        return HangSuspect(rank, rank // 2, state, step, last_beat, "no heartbeat")

    # peers blocked in the all-reduce beat at the same step, some even before the stopped rank's last beat
    assert culprit([suspect(0, WAITING, last_beat=99.9), suspect(3, STOPPED)]).rank == 3
    assert culprit([suspect(0, WAITING, last_beat=99.9), suspect(2, BUSY), suspect(1, WAITING)]).rank == 2
    assert culprit([suspect(0, WAITING), suspect(2, WAITING, step=19)]).rank == 2
    assert culprit([suspect(1, WAITING, last_beat=100.2), suspect(2, WAITING, last_beat=100.1)]).rank == 2
    assert culprit([suspect(2, WAITING), suspect(1, WAITING)]).rank == 1  # a full tie: the same on every node
    reports = [suspect(3, STOPPED), suspect(2, WAITING)]
    assert HangSuspect.decode_all(HangSuspect.encode_all(reports)) == reports
    assert HangSuspect.decode_all("garbage") == [] and HangSuspect.decode_all("[]") == []


def test_process_state_tells_stopped_busy_and_waiting_processes_apart():
    import signal
    import time

    from ftrun.launch.hangs import BUSY, STOPPED, WAITING, process_state

    sleeping = subprocess.Popen(["sleep", "60"])
    waiting = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
    try:
        time.sleep(1.0)
        with open(f"/proc/{sleeping.pid}/wchan") as f:
            if f.read() in ("", "0"):
                pytest.skip("this kernel does not show where a process waits (/proc/PID/wchan)")
        assert process_state(sleeping.pid) == BUSY  # sleeping in its own code, like a stuck rank
        assert process_state(waiting.pid) == WAITING  # on a futex, like a rank blocked in a gloo collective
        os.kill(sleeping.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert process_state(sleeping.pid) == STOPPED
        assert process_state(2 ** 22 + 1) == BUSY  # no such process: nothing to tell
    finally:
        for proc in (sleeping, waiting):
            proc.kill()
            proc.wait()


def test_clean_tells_each_jobs_shared_memory_files_apart():
    from ftrun.launch.clean import job_of

    for name, job in [("ftrun-slurm-7-node1-rank0-slot1", "slurm-7"), ("ftrun-a-b-node0-parity0", "a-b"),
                      ("ftrun-t1-node12-heartbeat", "t1"), ("ftrun-x.y-launcher", "x.y"), ("ftrun-j_1-secret", "j_1"),
                      ("ftrun-j-secret.4242", "j"), ("ftrun-slurm-7-host-n3", "slurm-7"),
                      ("ftrun-j-reserve-spare-0-rank1", "j")]:
        assert job_of(name) == job, name
    assert job_of("ftrun-keeper-x-node0") is None and job_of("other-file") is None and job_of("ftrun-x") is None


def test_clean_removes_a_dead_jobs_run_directories_too(tmp_path, monkeypatch):
    import tempfile

    from ftrun.launch.clean import job_files, remove

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("FTRUN_SHM_DIR", str(tmp_path / "shm"))
    for directory in ("tmp/ftrun-dead1-node0-ab_cd123/gen0/rank0", "tmp/ftrun-dead1-node0-too-long-to-be-ours",
                      "shm"):
        (tmp_path / directory).mkdir(parents=True)
    (tmp_path / "shm" / "ftrun-dead1-node0-heartbeat").write_bytes(b"x" * 10)
    (tmp_path / "tmp" / "ftrun-dead1-node1-file0000").write_text("")  # a file, not a run directory
    (entry,) = job_files("dead1")
    assert not entry.live and sorted(entry.paths) == [str(tmp_path / "shm" / "ftrun-dead1-node0-heartbeat"),
                                                     str(tmp_path / "tmp" / "ftrun-dead1-node0-ab_cd123")]
    assert remove(entry) == [] and not (tmp_path / "tmp" / "ftrun-dead1-node0-ab_cd123").exists()
    assert (tmp_path / "tmp" / "ftrun-dead1-node0-too-long-to-be-ours").exists()


def test_the_etcd_example_config_is_a_valid_job():
    from ftrun.launch.config import build_config

    cfg = build_config(str(ROOT / "configs" / "etcd-multinode.yaml"), {"node_rank": 1}, env={})
    assert cfg.rdzv_backend == "etcd" and cfg.nnodes == 4 and not cfg.local_mode
    standby = build_config(str(ROOT / "configs" / "etcd-multinode.yaml"), {"standby": True}, env={})
    assert standby.standby and not standby.local_mode


# The packages from the bottom up: a module imports only from its own layer or those below it.
LAYERS = (("ftrun.errors", "ftrun.events", "ftrun.startup"), ("ftrun.control",), ("ftrun.snapshot",), ("ftrun.ui",),
          ("ftrun.launch",), ("ftrun.cli", "ftrun.__main__", "ftrun.dcp", "ftrun"))


def _layer(module: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) for name in names
                 if module == name or (name != "ftrun" and module.startswith(name + "."))), None)


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of package ``ftrun`` under ``root`` it imports: also inside functions and under
    TYPE_CHECKING, relative imports resolved, and ``from package import module`` as that module."""
    import ast

    paths = {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
             for path in sorted((root / "ftrun").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = graph.setdefault(module, set())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
                source = ".".join(part for part in (base, node.module) if part)
                found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in paths else source
                             for alias in node.names)
        graph[module] = {name for name in found if name == "ftrun" or name.startswith("ftrun.")}
    return graph


def _layering_problems(graph: dict[str, set[str]]) -> list[str]:
    """What breaks the rules: a module in no layer, an import of a layer above, and each import cycle (modules that
    import each other, directly or through others)."""
    problems = [f"{m} is in no layer of LAYERS" for m in graph if _layer(m) is None]
    problems += [f"{m} imports {i}, a layer above it" for m, found in sorted(graph.items()) for i in sorted(found)
                 if None not in (_layer(m), _layer(i)) and _layer(i) > _layer(m)]
    reaches = {m: set(found) & graph.keys() for m, found in graph.items()}
    for _ in graph:  # to a fixed point: the modules each one reaches through its imports
        reaches = {m: set(r).union(*(reaches[i] for i in r)) for m, r in reaches.items()}
    cycles = {tuple(sorted(m for m in graph if m in reaches[start] and start in reaches[m]))
              for start in graph if start in reaches[start]}
    return problems + [f"import cycle: {', '.join(cycle)}" for cycle in sorted(cycles)]


def test_layers_point_down_and_no_modules_import_each_other():
    assert _layering_problems(_import_graph(ROOT)) == []


def test_the_layering_check_sees_an_upward_import_and_a_cycle_through_three_modules(tmp_path):
    files = {"ftrun/__init__.py": "", "ftrun/control/__init__.py": "", "ftrun/launch/__init__.py": "",
             "ftrun/control/a.py": "from ftrun.control import b\n",
             "ftrun/control/b.py": "def f():\n    from .c import g\n",
             "ftrun/control/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ftrun.control.a\n",
             "ftrun/control/d.py": "from ..launch import e\n", "ftrun/launch/e.py": "", "ftrun/new/f.py": ""}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _layering_problems(_import_graph(tmp_path)) == [
        "ftrun.new.f is in no layer of LAYERS", "ftrun.control.d imports ftrun.launch.e, a layer above it",
        "import cycle: ftrun.control.a, ftrun.control.b, ftrun.control.c"]


def test_the_cli_checks_its_input_without_importing_torch():
    """What runs before the launcher's exec (flags, config, handoff) imports no torch (1-2 s per job), nor numpy and
    pyeclib, which only the keepers' erasure coding needs (0.12 s of CPU per job)."""
    code = ("import sys, ftrun.cli, ftrun.launch.config, ftrun.launch.output, ftrun.launch.handoff; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'pyeclib'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_wakeup_is_an_event_that_select_sees_and_a_set_after_a_clear_is_kept():
    wake = Wakeup()
    assert not wake.is_set() and not select.select([wake], [], [], 0)[0]
    wake.set()
    wake.set()
    assert wake.is_set() and select.select([wake], [], [], 0)[0]
    wake.clear()
    assert not wake.wait(0.05)
    threading.Timer(0.1, wake.set).start()
    assert wake.wait(5) and select.select([wake], [], [], 0)[0]


def test_an_exit_watch_is_readable_when_a_child_exits_and_empty_once_it_is_forgotten():
    exits = ExitWatch()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        exits.watch(child.pid)
        if not exits.fds():
            pytest.skip("no pidfd_open here (Linux < 5.3)")
        assert not select.select(exits.fds(), [], [], 0)[0]  # running
        assert select.select(exits.fds(), [], [], 30)[0]  # exited (not yet reaped)
        deadline = time.monotonic() + 10
        while child.pid not in reap() and time.monotonic() < deadline:
            time.sleep(0.01)
        exits.forget(child.pid)
        assert exits.fds() == []
    finally:
        child.kill()
        child.wait()


def test_job_ids_in_file_names_never_collide_nor_climb():
    from ftrun.control.spec import safe_job_id

    names = {safe_job_id(job) for job in ("a/b", "a_b", "..", ".", "x" * 64 + "A", "x" * 64 + "B", "x" * 64)}
    assert len(names) == 7 and not names & {".", ".."}
    assert all(len(name) <= 64 and safe_job_id(name) == name for name in names)
    assert safe_job_id("slurm-12.0") == "slurm-12.0" and safe_job_id("a_b") == "a_b"  # safe ids stay as they are


def test_a_module_name_that_names_no_module_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """``-m train.py``, ``-m ''`` or ``-m dir/train`` started the job, whose trainers failed to import it twice
    (a crash loop, exit 3); a name that cannot be a module is now one line at once."""
    from ftrun.launch.handoff import resolve_target

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    cfg = JobConfig(module=True)
    for target, fragment in (("train.py", "train.py is a file, not a module name (drop -m, or -m train)"),
                             ("", "-m '' is not a module name"), ("pkg/train", "is not a module name")):
        with pytest.raises(UsageError, match=re.escape(fragment)):
            resolve_target(cfg, target)
    assert resolve_target(cfg, "pkg.train") == "pkg.train"  # found by the trainers' import


def test_no_python_says_why_a_file_it_cannot_run_is_not_run(tmp_path, monkeypatch):
    """--no-python with a shell script that is not executable, a directory, or a script of this directory named
    without ./ (the trainers look on PATH only) said "executable not found" of a file that is there; each now
    says what is wrong and how to run it."""
    from ftrun.launch.handoff import resolve_target

    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    monkeypatch.chdir(tmp_path)
    cfg = JobConfig(no_python=True)
    for target, fragment in ((str(script), "is not executable (chmod +x it, or drop --no-python"),
                             (str(tmp_path), "is a directory, not an executable"),
                             ("run.sh", "run.sh is not on PATH; ./run.sh runs the one in this directory")):
        with pytest.raises(UsageError, match=re.escape(fragment)):
            resolve_target(cfg, target)
    script.chmod(0o700)
    assert resolve_target(cfg, str(script)) == str(script)
