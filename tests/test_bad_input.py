"""Bad input: one line on stderr, exit code 2, nothing started and nothing left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import SCRIPTS, TRAIN_PLAIN, free_port, job_processes, job_segments
from ftrun.control.spec import shm_dir, write_shm_file
from ftrun.errors import UsageError
from ftrun.snapshot.dcp_copy import write_sums


def run_ftrun(*args: str, cwd=None, env: dict | None = None) -> tuple[int, str, str]:
    job_id = f"bad{uuid.uuid4().hex[:8]}"
    result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job_id, *args], capture_output=True,
                            text=True, timeout=60, cwd=cwd, env={**os.environ, **(env or {})})
    assert not job_processes(job_id) and not job_segments(job_id)
    return result.returncode, result.stderr, job_id


def assert_one_line_error(code: int, stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("ftrun: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def listening_port():
    """A port held by something that is not a control store."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]



@pytest.mark.parametrize("args, fragments", [
    (["--bogus", str(TRAIN_PLAIN)], ["No such option: --bogus"]),
    (["missing_script.py"], ["script not found: missing_script.py"]),
    (["--nproc-per-node", "0", str(TRAIN_PLAIN)], ["--nproc-per-node must be at least 1"]),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", str(TRAIN_PLAIN)],
     ["--node-rank 2 is out of range for --nnodes 2"]),
    (["--nnodes", "two", str(TRAIN_PLAIN)], ["Invalid value for '--nnodes'"]),
    (["--inject", "crash@rank=x,step=3", str(TRAIN_PLAIN)], ["crash@rank=x,step=3", "rank must be"]),
    (["--inject", "boom@rank=1,step=3", str(TRAIN_PLAIN)], ["unknown fault kind 'boom'"]),
    # digits int() does not read (str.isdigit accepts a superscript), or more than it reads: were tracebacks
    (["--inject", "crash@rank=0,step=\u00b2", str(TRAIN_PLAIN)], ["step must be a non-negative integer"]),
    (["--inject", "crash@rank=0,step=" + "9" * 5000, str(TRAIN_PLAIN)], ["step must be a non-negative integer"]),
    (["--rdzv-endpoint", "127.0.0.1:\u00b2", str(TRAIN_PLAIN)], ["--rdzv-endpoint must be HOST:PORT"]),
    (["--nproc-per-node", "\u00b2", str(TRAIN_PLAIN)], ["--nproc-per-node must be a number"]),
    (["--inject", "hang@rank=1", str(TRAIN_PLAIN)], ["missing step="]),
    (["--inject", "node-loss@rank=1,step=2", str(TRAIN_PLAIN)], ["unknown key 'rank' for node-loss"]),
    (["--no-python", "no-such-executable-ftrun"], ["executable not found"]),
    (["--rdzv-endpoint", "host:99999", str(TRAIN_PLAIN)], ["--rdzv-endpoint must be HOST:PORT"]),
    # etcd's list given to c10d: a node tried to resolve '127.0.0.1:1,127.0.0.1' until --rdzv-timeout (600 s)
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1,127.0.0.1:2", str(TRAIN_PLAIN)],
     ["must be one HOST:PORT for a c10d control store, got '127.0.0.1:1,127.0.0.1:2'", "--rdzv-backend etcd"]),
    (["--rdzv-endpoint", "nohostport", str(TRAIN_PLAIN)], ["host 'nohostport' does not resolve"]),  # port 29400
    # a typo: resolving it raised a UnicodeError traceback (idna: a label empty or over 63 characters)
    (["--rdzv-endpoint", "node0..cluster:29400", str(TRAIN_PLAIN)],
     ["--rdzv-endpoint host 'node0..cluster' is not a host name"]),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "x" * 64, "--master-port", "1", str(TRAIN_PLAIN)],
     ["is not a host name"]),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2..x", str(TRAIN_PLAIN)], ["'e2..x' is not a host name"]),
    (["--nnodes", "2", "--rdzv-endpoint", "localhost:0", str(TRAIN_PLAIN)],
     ["port 0 (any free port) is for a job of this host alone"]),
    (["--rdzv-bind", "127.0.0.1", str(TRAIN_PLAIN)], ["--rdzv-bind is for multi-node jobs"]),
    (["--rdzv-endpoint", "198.51.100.7:29500", str(TRAIN_PLAIN)], ["198.51.100.7:29500 is not on this host"]),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-bind", "198.51.100.77",
      str(TRAIN_PLAIN)], ["--rdzv-bind 198.51.100.77 is not an address of this host"]),
    (["--nnodes", "2", "--ec-parity", "2", str(TRAIN_PLAIN)], ["--ec-parity 2 must be smaller than --ec-group 2"]),
    (["--nnodes", "2", "--ec-group", "4", str(TRAIN_PLAIN)], ["--ec-group 4 is larger than --nnodes 2"]),
    (["--nnodes", "4", "--ec-group", "3", str(TRAIN_PLAIN)], ["--nnodes 4 cannot be divided into groups"]),
    (["--nnodes", "2", "--ec-backend", "jerasure_rs_vand", str(TRAIN_PLAIN)], ["'jerasure_rs_vand' is not available"]),
    (["--spares", "-1", str(TRAIN_PLAIN)], ["--spares must be at least 0 and at most 65536 (as --nnodes), got -1"]),
    (["--spares", str(10**30), str(TRAIN_PLAIN)], ["--spares must be at least 0 and at most 65536"]),
    # far beyond any cluster: a MemoryError traceback (a list per node), or a spin in O(nnodes) loops
    (["--nnodes", "99999999999", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", str(TRAIN_PLAIN)],
     ["--nnodes must be at least 1 and at most 65536, got 99999999999"]),
    (["--nnodes", "1:99999999999", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", str(TRAIN_PLAIN)],
     ["--nnodes must be at least 1 and at most 65536"]),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "99999999999",
      str(TRAIN_PLAIN)], ["--nproc-per-node must be at least 1 and at most 1024, got 99999999999"]),
    (["--standby", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", str(TRAIN_PLAIN)],
     ["--standby joins a job as a spare without a node rank"]),
    (["--standby", str(TRAIN_PLAIN)], ["--standby needs --rdzv-endpoint"]),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", "--spares", "1", str(TRAIN_PLAIN)],
     ["--spares is for jobs simulated on one host", "ftrun --standby"]),
    (["--rdzv-backend", "zookeeper", str(TRAIN_PLAIN)], ["--rdzv-backend must be c10d, static or etcd"]),
    (["--rdzv-backend", "etcd-v2", str(TRAIN_PLAIN)], ["use --rdzv-backend etcd"]),
    (["--rdzv-backend", "etcd", str(TRAIN_PLAIN)], ["--rdzv-backend etcd needs --rdzv-endpoint"]),
    (["--rdzv-conf", "protocol=https", str(TRAIN_PLAIN)], ["settings are for --rdzv-backend etcd"]),
    (["--ckpt-format", "dcp", str(TRAIN_PLAIN)], ["--ckpt-format dcp needs --ckpt-dir"]),
    (["--ckpt-format", "zip", "--ckpt-dir", "x", str(TRAIN_PLAIN)], ["--ckpt-format must be one of ftrun, dcp"]),
    (["--log-dir", "/proc/ftrun-no-such-dir", str(TRAIN_PLAIN)],
     ["--log-dir /proc/ftrun-no-such-dir: cannot create the directory (No such file or directory)"]),
    (["--ckpt-dir", "/proc/ftrun-no-such-dir", str(TRAIN_PLAIN)],
     ["--ckpt-dir /proc/ftrun-no-such-dir: cannot create"]),
    (["--ckpt-dir", "/proc", str(TRAIN_PLAIN)], ["--ckpt-dir /proc: cannot write a file in the directory"]),
    (["--log-dir", "/sys", str(TRAIN_PLAIN)], ["--log-dir /sys: cannot write a file in the directory"]),
    (["--nnodes", "1000", "--nproc-per-node", "1000", str(TRAIN_PLAIN)],
     ["1000 node(s) and 1000000 trainer(s) on this host", "core(s)", "available", "--node-rank N", "srun"]),
])
def test_bad_flags(args, fragments):
    assert_one_line_error(*run_ftrun(*args)[:2], *fragments)


def test_a_node_of_a_multi_node_job_that_cannot_fit_this_host_memory_is_one_line():
    """--nproc-per-node 1024 on one node of a multi-node job started that node (and up to 1024 trainers once its
    peers joined) with no check of this host: the local mode's memory floor now applies to it (not its cores)."""
    from ftrun.launch.capacity import needed_memory, this_host

    if this_host().memory >= needed_memory(1, 1024):
        pytest.skip("this host has the memory of 1024 trainers")
    args = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node",
            "1024", str(TRAIN_PLAIN)]
    assert_one_line_error(*run_ftrun(*args)[:2], "--nproc-per-node 1024: this node and its 1024 trainer(s) need",
                          "fewer trainers")


@pytest.mark.parametrize("args, env", [
    (["--nnodes", "x" * 5000], {}),
    (["--rdzv-backend=" + "x" * 5000], {}),
    (["--inject", "crash@rank=0,step=" + "x" * 5000], {}),
    ([], {"PET_NPROC_PER_NODE": "x" * 5000}),
    ([], {"FTRUN_SHM_DIR": "/" + "x" * 5000}),
])
def test_a_very_long_value_is_shortened_in_the_error_line(args, env):
    """A 5000-character value of a flag or variable was echoed whole in the one-line error (a YAML key's is cut by
    reprlib): now cut the same way, its start and end kept."""
    code, stderr, _ = run_ftrun(*args, str(SCRIPTS / "hello.py"), env=env)
    assert_one_line_error(code, stderr, "xxx...xxx")
    assert len(stderr) < 400, stderr


def test_a_directory_without_main_and_a_file_as_directory(tmp_path):
    (tmp_path / "app").mkdir()
    assert_one_line_error(*run_ftrun(str(tmp_path / "app"))[:2], f"cannot run directory {tmp_path / 'app'}",
                          "no __main__.py")
    os.mkfifo(tmp_path / "pipe.py")
    assert_one_line_error(*run_ftrun(str(tmp_path / "pipe.py"))[:2], f"script {tmp_path / 'pipe.py'} is not a regular "
                          "file")
    (tmp_path / "file").write_text("")
    for flag in ("--log-dir", "--ckpt-dir"):
        assert_one_line_error(*run_ftrun(flag, str(tmp_path / "file"), str(TRAIN_PLAIN))[:2],
                              f"{flag} {tmp_path / 'file'} is not a directory")


def test_a_log_or_checkpoint_directory_every_user_may_write_is_refused_before_anything_is_written(tmp_path):
    """In a directory such as /tmp another user could plant a link at ``events.jsonl`` or at the job's checkpoint
    directory: ftrun would append its events to the link's target, or write checkpoints where that user reads and
    changes them before a resume loads them. A directory of one's own inside it is fine."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (shared / "events.jsonl").symlink_to(victim)
    for flag in ("--log-dir", "--ckpt-dir"):
        code, stderr, _ = run_ftrun(flag, str(shared), str(TRAIN_PLAIN))
        assert_one_line_error(code, stderr, f"{flag} {shared} is writable by every user (mode 1777)",
                              "give a directory of your own in it")
    assert victim.read_text() == "precious" and sorted(os.listdir(shared)) == ["events.jsonl"]


@pytest.mark.parametrize("text, fragments", [
    ("nnodez: 2\n", ["unknown key 'nnodez'"]),
    ("nnodes: two\n", ["key 'nnodes' must be int", "'two'"]),
    ("hang_timeout: [1]\n", ["key 'hang_timeout' must be float"]),
    ("inject: crash@rank=1,step=2\n", ["key 'inject' must be list"]),
    ("- just\n- a list\n", ["top level must be a mapping"]),
    ("nnodes: [\n", ["not valid YAML"]),
    ("nnodes: 1\nnnodes: 2\n", ["not valid YAML at line 2: key 'nnodes' is given twice"]),
    ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nrole: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
     ["unknown key 'a'"]),
    ("nnodes: [&c [[[x, x, x, x, x, x, x, x, x]]], *c, *c, *c, *c, *c, *c, *c, *c]\n",
     ["key 'nnodes' must be int or str, got [[[...]], [[...]], [[...]], [[...]], ...]"]),
    ("nnodes: 1\n\xff\xfe\n", ["not UTF-8 text (byte 10)"]),
    ("#" * (1 << 20) + "\n", ["a config file of more than 1024 KiB is not a config file"]),
    ("[" * 5000 + "]" * 5000 + "\n", ["not a config file (its YAML is nested too deep)"]),  # was a RecursionError
])
def test_bad_yaml_names_key_and_file(tmp_path, text, fragments):
    config = tmp_path / "job.yaml"
    config.write_bytes(text.encode("latin-1"))
    assert_one_line_error(*run_ftrun("--config", str(config), str(TRAIN_PLAIN))[:2], str(config), *fragments)


@pytest.mark.timeout(60)
def test_a_config_that_is_a_fifo_or_a_directory_is_one_line(tmp_path):
    """A FIFO nobody writes to blocked the start forever."""
    os.mkfifo(tmp_path / "job.yaml")
    assert_one_line_error(*run_ftrun("--config", str(tmp_path / "job.yaml"), str(TRAIN_PLAIN))[:2],
                          f"cannot read config file {tmp_path / 'job.yaml'}: not a regular file")
    assert_one_line_error(*run_ftrun("--config", str(tmp_path), str(TRAIN_PLAIN))[:2],
                          f"cannot read config file {tmp_path}: not a regular file")


def test_control_store_port_in_use_local_mode(listening_port):
    code, stderr, _ = run_ftrun("--rdzv-endpoint", f"127.0.0.1:{listening_port}", str(TRAIN_PLAIN))
    assert_one_line_error(code, stderr, f"port {listening_port} is already in use", "with --rdzv-endpoint")
    code, stderr, _ = run_ftrun("--master-port", str(listening_port), str(TRAIN_PLAIN))
    assert_one_line_error(code, stderr, f"port {listening_port} is already in use", "with --master-port")


def test_control_store_port_in_use_by_something_else_multi_node(listening_port):
    code, stderr, _ = run_ftrun("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                                f"127.0.0.1:{listening_port}", str(TRAIN_PLAIN))
    assert_one_line_error(code, stderr, "is not a torch TCPStore")


def test_unreachable_endpoint_within_timeout():
    port = free_port()
    code, stderr, _ = run_ftrun("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                "--rdzv-timeout", "1", str(TRAIN_PLAIN))
    assert_one_line_error(code, stderr, f"127.0.0.1:{port} is unreachable after 1s")


def test_etcd_backend_at_a_port_that_is_not_etcd(listening_port):
    code, stderr, _ = run_ftrun("--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{listening_port}",
                                "--rdzv-timeout", "2", str(TRAIN_PLAIN))
    assert_one_line_error(code, stderr, f"127.0.0.1:{listening_port}")


def test_etcd_backend_at_a_port_nobody_listens_on():
    code, stderr, _ = run_ftrun("--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                                "--rdzv-timeout", "1", str(TRAIN_PLAIN))
    assert_one_line_error(code, stderr, "unreachable after 1s")


def test_a_step_persisted_at_another_world_size_is_not_resumed_nor_lost(tmp_path):
    """The newest persisted step of the job has 2 ranks, the run 1, no DCP copy: refused before anything starts
    (the step stays as it was)."""
    job = "bad-world"
    step = tmp_path / "ckpt" / job / "step-00000010"
    step.mkdir(parents=True)
    ranks = {str(r): {"file": f"rank-{r:05d}.snap", "bytes": 4096, "checksum": 1, "digest": 1} for r in range(2)}
    (step / "manifest.json").write_text(json.dumps({"format": 1, "job": job, "step": 10, "world": 2, "nnodes": 1,
                                                    "nproc_per_node": 2, "time": 0, "ranks": ranks}))
    result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job, "--ckpt-dir", str(tmp_path / "ckpt"),
                             str(TRAIN_PLAIN), "--steps", "1"], capture_output=True, text=True, timeout=60)
    assert_one_line_error(result.returncode, result.stderr, "cannot resume job bad-world", "newest persisted step, 10,",
                          "saved at world size 2 and this run has 1", "--ckpt-format dcp", "--no-resume")
    assert not job_processes(job) and not job_segments(job)
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json"]


def steps_at_world_2(root: Path, *numbers: int) -> None:
    """Complete-looking steps ``numbers`` of 2 ranks in the job directory ``root`` (manifests only)."""
    for number in numbers:
        step = root / f"step-{number:08d}"
        step.mkdir(parents=True)
        ranks = {str(r): {"file": f"rank-{r:05d}.snap", "bytes": 4096, "checksum": 1, "digest": 1} for r in range(2)}
        (step / "manifest.json").write_text(json.dumps({"format": 1, "job": root.name, "step": number, "world": 2,
                                                        "nnodes": 1, "nproc_per_node": 2, "time": 0, "ranks": ranks}))


def resume_at_world_1(ckpt: Path, job: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job, "--ckpt-dir", str(ckpt),
                           str(SCRIPTS / "hello.py")], capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_at_another_world_size_a_resume_goes_on_when_an_older_step_has_a_dcp_copy(tmp_path):
    """A job killed whole while its newest step's DCP copy was written: an older step's copy is the one
    ftrun.dcp.MemoryReader reshards; the resume says which instead of refusing."""
    job = f"older-dcp-{uuid.uuid4().hex[:6]}"
    steps_at_world_2(tmp_path / "ckpt" / job, 10, 20)
    (tmp_path / "ckpt" / job / "step-00000010" / "dcp").mkdir()
    result = resume_at_world_1(tmp_path / "ckpt", job)
    assert "the newest persisted step, 20, was saved at world size 2 and this run has 1: ftrun.dcp.MemoryReader " \
        "loads the newest DCP copy, step 10's (" in result.stderr + result.stdout, result.stderr
    assert result.returncode == 0, result.stderr
    assert not job_processes(job) and not job_segments(job)


@pytest.mark.timeout(120)
def test_at_another_world_size_a_corrupt_dcp_copy_is_never_loaded(tmp_path):
    """DCP's files carry no checksum: a DCP copy with a flipped bit (a disk, a copy between file systems) was loaded
    by ftrun.dcp.MemoryReader, resharded, without a word. A copy records the CRC-32 of its files; a resume at
    another world size checks the copy it would load, moves a corrupt one aside (kept) and falls to the next one."""
    job = f"bad-dcp-{uuid.uuid4().hex[:6]}"
    root = tmp_path / "ckpt" / job
    steps_at_world_2(root, 10, 20)
    for number, data in ((10, b"good"), (20, b"flipped")):
        copy = root / f"step-{number:08d}" / "dcp"
        copy.mkdir()
        (copy / "__0_0.distcp").write_bytes(b"good")
        write_sums(str(copy))
        (copy / "__0_0.distcp").write_bytes(data)
    result = resume_at_world_1(tmp_path / "ckpt", job)
    said = result.stderr + result.stdout
    assert "WARNING the DCP copy of step 20 is corrupt (__0_0.distcp does not hold the bytes written" in said, said
    assert "loads the newest DCP copy, step 10's (" in said and result.returncode == 0, said
    assert sorted(os.listdir(root / "step-00000020")) == ["dcp.corrupt", "manifest.json"]
    assert not job_processes(job) and not job_segments(job)


@pytest.mark.parametrize("kind", ["file", "link-loop"])
def test_a_job_directory_in_the_checkpoint_directory_that_is_no_directory_is_one_line(tmp_path, kind):
    """<ckpt-dir>/<job> a file: the job ran, every persist failed, and it exited 0 with nothing on disk; a link loop:
    a traceback (ELOOP). Either is refused before anything starts."""
    job = f"bad{uuid.uuid4().hex[:8]}"
    if kind == "file":
        (tmp_path / job).write_text("x")
    else:
        (tmp_path / job).symlink_to(job)
    result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job, "--ckpt-dir", str(tmp_path),
                             str(SCRIPTS / "hello.py")], capture_output=True, text=True, timeout=60)
    assert_one_line_error(result.returncode, result.stderr, f"this job's directory {tmp_path / job} is not a directory")
    assert not job_processes(job) and not job_segments(job)


def test_a_shape_record_of_garbage_bytes_left_in_the_shm_dir_starts_the_job_clean():
    """The keeper read a node's shape record as UTF-8: bytes that are not (a damaged /dev/shm file) made it fail to
    start, and the job failed (exit 3) until its files were removed by hand."""
    job = f"bad{uuid.uuid4().hex[:8]}"
    path = os.path.join(shm_dir(), f"ftrun-{job}-node0-shape")
    with open(path, "wb") as f:
        f.write(b"\x8c\xff garbage")
    try:
        result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job, str(SCRIPTS / "hello.py")],
                                capture_output=True, text=True, timeout=60)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert result.returncode == 0, result.stderr
    assert not job_processes(job) and not job_segments(job)


def test_a_resume_names_newer_step_directories_it_skips_and_removes_unfinished_steps(tmp_path):
    """A step directory whose manifest was edited (or is missing, or another job's) is never loaded: the resume
    says so in one line, where it went past it silently."""
    job = f"edited-{uuid.uuid4().hex[:6]}"
    step = tmp_path / "ckpt" / job / "step-00000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"format": 1, "step": 10, "world": "2"}')
    unfinished = tmp_path / "ckpt" / job / ".step-00000030.partial"  # a run killed while it persisted step 30
    unfinished.mkdir()
    (unfinished / "rank-00000.snap").write_bytes(bytes(4096))
    result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job, "--ckpt-dir", str(tmp_path / "ckpt"),
                             str(SCRIPTS / "hello.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"WARNING 1 step directory in {tmp_path / 'ckpt' / job} not resumed from: step-00000010 is not a " \
           f"complete step of this job ({step / 'manifest.json'}: not an ftrun format-1 manifest of step 10)" \
           in result.stdout + result.stderr
    assert (step / "manifest.json").read_text() == '{"format": 1, "step": 10, "world": "2"}'  # left as it was
    assert not unfinished.exists() and "removed 1 unfinished step(s) an earlier run of job" in result.stderr
    assert not job_processes(job) and not job_segments(job)


@pytest.mark.parametrize("where", ["missing", "a-file", "relative"])
def test_a_shm_dir_that_is_not_a_writable_directory_is_one_line(tmp_path, where):
    (tmp_path / "a-file").write_text("")
    directory = "shm" if where == "relative" else str(tmp_path / where)
    code, stderr, _ = run_ftrun(str(SCRIPTS / "hello.py"), env={"FTRUN_SHM_DIR": directory})
    assert_one_line_error(code, stderr, f"the shared-memory directory {directory} (FTRUN_SHM_DIR) is not a writable "
                          "directory")


def test_a_value_with_a_line_break_is_still_one_error_line():
    """FTRUN_SHM_DIR='a<newline>b' printed its error on two lines."""
    code, stderr, _ = run_ftrun(str(SCRIPTS / "hello.py"), env={"FTRUN_SHM_DIR": "/no/such\ndir"})
    assert_one_line_error(code, stderr, "the shared-memory directory /no/such\\ndir (FTRUN_SHM_DIR) is not")


def test_a_shm_dir_where_no_file_can_be_made_is_one_line(small_tmpfs):
    """Room for bytes but no inode left (a tmpfs's nr_inodes, shared by many jobs): os.access passes, a file fails."""
    full = small_tmpfs(64, "nr_inodes=4")
    with pytest.raises(OSError):
        for i in range(8):
            (full / f"taken-{i}").write_text("")
    code, stderr, _ = run_ftrun(str(SCRIPTS / "hello.py"), env={"FTRUN_SHM_DIR": str(full)})
    assert_one_line_error(code, stderr, f"the shared-memory directory {full} (FTRUN_SHM_DIR): cannot make a file "
                          "there (No space left on device)")


def test_a_shm_dir_filled_after_the_start_check_is_one_line_and_leaves_no_file(small_tmpfs):
    """The launcher's small files there (the job's secret for `ftrun status`, its announce file): filled between
    the start's check and their writing (another job's slots), the start was a traceback and left a temporary."""
    full = small_tmpfs(1)
    subprocess.run(["dd", "if=/dev/zero", f"of={full / 'fill'}", "bs=4k"], capture_output=True, check=False)
    with pytest.raises(UsageError, match=f"cannot write {full}/ftrun-job-secret: No space left on device "
                                         r"\(0.0 MiB free there; ftrun keeps its snapshots in this directory"):
        write_shm_file(str(full / "ftrun-job-secret"), "ab" * 32)
    assert os.listdir(full) == ["fill"]


@pytest.mark.parametrize("spec, fragment", [
    ("crash@rank=2,step=1", "--inject 'crash@rank=2,step=1': the job has 2 rank(s), numbered from 0"),
    ("node-loss@node=1,step=1", "the job has 1 node(s)"),
    ("crash@rank=0,step=1,step=2", "step is given twice"),
    # a generation past the restart limit: the job ended before it, the rehearsed failure never happened
    ("crash@rank=0,step=1,gen=11", "the job restarts at most 10 time(s) (--max-restarts), so generation 11 never"),
])
def test_an_injected_fault_that_could_never_fire_is_refused(spec, fragment):
    assert_one_line_error(*run_ftrun("--nproc-per-node", "2", "--inject", spec, str(TRAIN_PLAIN))[:2], fragment)


def test_ftrun_store_refuses_a_port_out_of_range_and_an_empty_host():
    for args, fragment in ((["--port", "70000"], "--port must be a port (0-65535"),
                           (["--port", "-1"], "--port must be a port"),
                           (["--host", ""], "--host must not be empty")):
        done = subprocess.run([sys.executable, "-m", "ftrun", "store", *args], capture_output=True, text=True,
                              timeout=60)
        assert_one_line_error(done.returncode, done.stderr, fragment)
