"""One run at a time writes a job's checkpoint directory (:mod:`ftrun.snapshot.dir_owner`): a second run of the
job sharing the directory is refused while the first lives, and takes it over once the first is gone; on another
host "gone" is judged by the holder's beat, never by comparing two hosts' clocks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import pytest

from conftest import SCRIPTS
from ftrun.errors import UsageError
from ftrun.snapshot.dir_owner import OWNER_FILE, DirOwner, Holder, check, read_holder, this_process

JOB = "job-a"


def write_record(root: Path, holder: Holder, age: float = 0.0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    path = root / OWNER_FILE
    path.write_text(json.dumps(asdict(holder)))
    if age:
        stamp = time.time() - age
        os.utime(path, (stamp, stamp))


def elsewhere(run: str = "other-run", beat: int = 0) -> Holder:
    """A holder on another host: only its beat can tell whether it lives."""
    return Holder(run, "some-other-host", "boot-of-another-host", "pid:[1]", 4242, 1.0e9, beat)


class Said(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def test_no_record_or_one_of_this_run_goes_on_at_once(tmp_path):
    said = Said()
    assert check(str(tmp_path / "missing"), "run-a", JOB, said) is None
    write_record(tmp_path, replace(elsewhere(), run="run-a"))
    assert check(str(tmp_path), "run-a", JOB, said) is None
    assert said == []


def test_a_live_run_on_this_host_is_refused_at_once_and_its_record_goes_with_it(tmp_path):
    said = Said()
    owner = DirOwner(str(tmp_path / "dir"), "run-a", said)
    owner.take()
    try:
        record = tmp_path / "dir" / OWNER_FILE
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
        started = time.monotonic()
        with pytest.raises(UsageError, match=f"held by another run of the job \\(host {socket.gethostname()}, pid "
                                             f"{os.getpid()}; .*--rdzv-id or --ckpt-dir"):
            check(str(tmp_path / "dir"), "run-b", JOB, said)
        assert time.monotonic() - started < 1.0  # no wait for a beat: its process is seen alive
    finally:
        owner.close()
    assert not record.exists() and said == []


def test_a_dead_process_of_this_host_or_a_reused_pid_is_taken_over_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = replace(this_process("run-a"), pid=proc.pid, started=psutil.Process(proc.pid).create_time())
    finally:
        proc.kill()
        proc.wait()
    for holder in (dead, replace(this_process("run-a"), started=1.0e9)):  # this pid, but another process's start
        write_record(tmp_path, holder)
        started = time.monotonic()
        assert check(str(tmp_path), "run-b", JOB, Said()) == holder
        assert time.monotonic() - started < 1.0


def test_a_run_on_another_host_is_refused_once_it_beats(tmp_path):
    write_record(tmp_path, elsewhere())
    stop = threading.Event()

    def beat() -> None:
        count = 0
        while not stop.wait(0.2):
            count += 1
            write_record(tmp_path, elsewhere(beat=count))

    beater = threading.Thread(target=beat)
    beater.start()
    said = Said()
    started = time.monotonic()
    try:
        with pytest.raises(UsageError, match="host some-other-host, pid 4242; it beat 0 s ago"):
            check(str(tmp_path), "run-b", JOB, said, stale_after=10.0)
    finally:
        stop.set()
        beater.join()
    assert time.monotonic() - started < 3.0
    assert len(said) == 1 and "waiting up to 10 s for a sign of life" in said[0], said


def test_a_silent_run_on_another_host_is_taken_over_after_the_wait_less_its_age_on_the_file_servers_clock(tmp_path):
    write_record(tmp_path, elsewhere())
    said = Said()
    started = time.monotonic()
    assert check(str(tmp_path), "run-b", JOB, said, stale_after=1.5) == elsewhere()
    assert 1.0 < time.monotonic() - started < 4.0 and len(said) == 1
    write_record(tmp_path, elsewhere(), age=100.0)  # silent for longer than the wait: no wait at all
    said.clear()
    started = time.monotonic()
    assert check(str(tmp_path), "run-b", JOB, said, stale_after=15.0) == elsewhere()
    assert time.monotonic() - started < 1.0 and said == []
    assert [p.name for p in tmp_path.iterdir()] == [OWNER_FILE]  # the probe that read the server's clock is gone


def test_a_run_of_an_earlier_step_of_the_same_slurm_job_is_taken_over_at_once(tmp_path):
    """ftrun's batch loop runs a SLURM job's steps one after the other (a lost node 0's step ends on every node
    before the next one starts elsewhere), and a requeued job runs again only once its allocation ended."""
    write_record(tmp_path, replace(elsewhere(), slurm="81234"))
    said = Said()
    started = time.monotonic()
    assert check(str(tmp_path), "run-b", JOB, said, slurm="81234") == replace(elsewhere(), slurm="81234")
    assert time.monotonic() - started < 1.0 and said == []
    assert check(str(tmp_path), "run-b", JOB, said, slurm="81235", stale_after=0.5) is not None  # another job's
    assert len(said) == 1  # waited for its beat


@pytest.mark.parametrize("content", ["garbage", "[1, 2]", '{"run": "x"}',
                                     json.dumps({**asdict(elsewhere()), "pid": "1"}),
                                     json.dumps({**asdict(elsewhere()), "extra": 1}), "[" * 100000, "fifo"])
def test_what_is_not_a_record_is_ignored(tmp_path, content):
    path = tmp_path / OWNER_FILE
    if content == "fifo":
        os.mkfifo(path)  # would block a reader forever
    else:
        path.write_text(content)
    started = time.monotonic()
    assert read_holder(str(tmp_path)) is None
    assert check(str(tmp_path), "run-b", JOB, Said()) is None
    assert time.monotonic() - started < 1.0


def test_the_holder_beats_until_another_run_takes_the_directory_and_then_says_so_once(tmp_path):
    said = Said()
    owner = DirOwner(str(tmp_path), "run-a", said, refresh=0.05)
    owner.take()
    try:
        deadline = time.monotonic() + 10
        while (found := read_holder(str(tmp_path))) is not None and found[0].beat < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        write_record(tmp_path, elsewhere())  # a run that judged this one dead
        time.sleep(0.5)
        assert read_holder(str(tmp_path))[0] == elsewhere()  # not overwritten
        assert len(said) == 1 and "was taken by another run of this job (host some-other-host" in said[0], said
    finally:
        owner.close()
    assert read_holder(str(tmp_path))[0] == elsewhere()  # not removed either


def test_a_replacement_node_0_of_the_same_run_takes_over_quietly(tmp_path):
    said = Said()
    owner = DirOwner(str(tmp_path), "run-a", said, refresh=0.05)
    owner.take()
    try:
        write_record(tmp_path, elsewhere(run="run-a"))
        time.sleep(0.4)
    finally:
        owner.close()
    assert read_holder(str(tmp_path))[0] == elsewhere(run="run-a") and said == []


def test_a_directory_that_cannot_hold_a_record_is_a_warning_not_a_failure(tmp_path):
    (tmp_path / "file").write_text("")
    said = Said()
    owner = DirOwner(str(tmp_path / "file" / "job"), "run-a", said)
    owner.take()
    owner.close()
    assert len(said) == 1 and "cannot write" in said[0] and "would not be refused" in said[0], said


@pytest.mark.timeout(60)
def test_a_beat_on_a_full_disk_leaves_no_temporary_record_behind(small_tmpfs):
    """The disk of the checkpoint directory fills while the job runs: each failed beat left its empty temporary
    record (``.owner.<host>.<pid>``) in the job's directory, where it stayed after the run. A failed beat removes
    its temporary record; the warning is said once."""
    root = small_tmpfs(1) / JOB
    said = Said()
    owner = DirOwner(str(root), "run-a", said, refresh=0.05)
    owner.take()
    try:
        with open(root.parent / "filler", "wb", buffering=0) as filler:  # the disk fills
            with pytest.raises(OSError):
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
        deadline = time.monotonic() + 10
        while not said:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # a few more beats fail
    finally:
        owner.close()
    assert len(said) == 1 and "No space left on device" in said[0], said
    assert os.listdir(root) == [], os.listdir(root)


def other_host() -> tuple[str, ...]:
    """The command prefix that runs ftrun as on another host sharing this one's filesystems: a network, a host name
    and a /dev/shm of its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("another host is simulated with unshare(1) and ip(8), as root")
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --net --uts --mount: {probe.stderr.strip()}")
    return ("unshare", "--net", "--uts", "--mount", "--propagation", "private", "sh", "-c",
            'ip link set lo up && hostname ftrun-other-host && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"',
            "sh")


@pytest.mark.timeout(120)
def test_a_second_run_on_another_host_sharing_the_ckpt_dir_is_refused_and_runs_once_the_first_ended(start_job,
                                                                                                      tmp_path):
    ckpt = tmp_path / "ckpt"
    sleeper = (str(SCRIPTS / "sleeper.py"), "--seconds")
    first = start_job("--ckpt-dir", str(ckpt), *sleeper, "60")
    record = ckpt / first.job_id / OWNER_FILE
    first.wait_for_event(lambda e: e["event"] == "start")
    assert read_holder(str(record.parent))[0].pid == first.proc.pid
    second = start_job("--ckpt-dir", str(ckpt), *sleeper, "1", job_id=first.job_id, prefix=other_host(),
                       log_dir=tmp_path / "second")
    assert second.wait(60) == 2, second.output
    lines = [line for line in second.output.splitlines() if line.startswith("ftrun: error: ")]
    assert len(lines) == 1 and f"held by another run of the job (host {socket.gethostname()}, pid " \
        f"{first.proc.pid}" in lines[0], second.output
    assert first.proc.poll() is None  # untouched
    os.killpg(first.proc.pid, signal.SIGTERM)
    assert first.wait(60) != 2
    assert not record.exists()
    third = start_job("--ckpt-dir", str(ckpt), *sleeper, "1", job_id=first.job_id, prefix=other_host(),
                      log_dir=tmp_path / "third")
    assert third.wait(60) == 0, third.output
    assert "taken over" not in third.output and not record.exists()
