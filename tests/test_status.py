"""``ftrun status``: rendering of recorded status documents, JSON of real jobs, bad input, and the live view in a
real terminal (tmux)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from conftest import ROOT, TRAIN_GPT, free_port, job_processes, job_segments
from debian_packages import apt_install
from ftrun.control.spec import shm_dir
from ftrun.ui.summary import Recovery
from ftrun.ui.live import LiveView
from ftrun.ui.status import JobStatus, NodeStatus, RankStatus, Tier
from ftrun.ui.view import beat, render

WIDTH, HEIGHT = 100, 30


# -- recorded status documents -------------------------------------------------------------------------------------

def ranks_of(node: int, nproc: int = 2, step: int = 123, beat_age: float = 0.3) -> list[RankStatus]:
    return [RankStatus(rank=node * nproc + local, pid=41000 + node * nproc + local, step=step, beat_age=beat_age,
                       timeout=30.0, steps_per_s=9.26, snapshot_step=120, snapshot_age=1.2, snapshot_bytes=1274042,
                       copy_gbs=0.44) for local in range(nproc)]


def node_doc(node: int, state: str = "running", gen: int = 0, **kwargs) -> NodeStatus:
    doc = {"time": 1000.0, "state": state, "generation": gen, "group": 0, "shm_bytes": 10_634_624, "committed": 120,
           "ranks": ranks_of(node), **kwargs}
    return NodeStatus(node=node, **doc)


def tiers(disk: Tier | None = None) -> list[Tier]:
    found = [Tier("RAM", 120, 1.2, "newest step every rank holds"),
             Tier("EC parity", 120, None, "1 group(s), the least protected")]
    return found + ([disk] if disk else [])


CRASH = Recovery(1, "crash", "rank 1 killed by SIGKILL", "waitpid", 0.55, (20, "RAM"), 25)
NODE_LOST = Recovery(2, "node-lost", "node 1 lost: no supervisor beat for 5.2s", "node 0 (supervisor beats)",
                     None, None, 131)


def healthy() -> JobStatus:
    """2 nodes x 2 trainers, running, one recovered crash, disk tier fine."""
    return JobStatus("thealthy01", 2, 2, "running", 1, 75.3, 1, 0.941, {n: node_doc(n, gen=1) for n in range(2)}, [],
                     {0: 120}, tiers(Tier("disk", 100, 12.0, "")), [CRASH])


def lost_and_degraded() -> JobStatus:
    """Node 1's document is stale (lost); the disk is full."""
    nodes = {0: node_doc(0, gen=1), 1: node_doc(1, gen=1, time=990.0, ranks=ranks_of(1, beat_age=12.0))}
    disk = Tier("disk", 100, 42.0, "disk full: [Errno 28] No space left on device", degraded=True)
    return JobStatus("tlost00001", 2, 2, "running", 1, 300.0, 1, 0.87, nodes, [1], {0: 120}, tiers(disk), [CRASH])


def restarting_with_rebuild() -> JobStatus:
    """Generation 2 after a lost node: node 1 (a replacement) rebuilds from parity; ten failures so far."""
    nodes = {0: node_doc(0, "restarting", 2), 1: node_doc(1, "rebuilding", 2, incarnation=2, shm_bytes=0)}
    events = [Recovery(g, "crash", f"trainer {g} killed by SIGKILL", "waitpid", 0.5, (10 * g, "RAM"), 10 * g + 3)
              for g in range(1, 10)] + [NODE_LOST]
    return JobStatus("trebuild01", 2, 2, "restarting", 10, 4000.0, 10, 0.52, nodes, [], {0: 120}, tiers(), events)


STATUSES = [healthy, lost_and_degraded, restarting_with_rebuild]


def rendered(status: JobStatus, width: int = WIDTH) -> str:
    console = Console(record=True, width=width, height=HEIGHT, force_terminal=True)
    console.print(render(status, width))
    return console.export_text()


def line_with(text: str, fragment: str) -> str:
    found = [line for line in text.splitlines() if fragment in line]
    assert len(found) == 1, f"{fragment!r} is on {len(found)} lines:\n{text}"
    return found[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", STATUSES)
def test_every_section_is_shown_without_wrapping(make):
    status = make()
    text = rendered(status)
    lines = text.splitlines()
    assert lines[0].startswith(f"job {status.job}  {status.state}  gen {status.generation}"), text
    assert "restarts" in lines[0] and "goodput" in lines[0]
    for title in ("nodes", "tiers", "ranks", "failures"):
        assert any(title in line.split() for line in lines[1:]), f"no {title} section:\n{text}"
    assert max(len(line) for line in lines) <= WIDTH, text
    assert len(lines) <= HEIGHT, text
    for doc in status.nodes.values():
        for rank in doc.ranks:
            assert line_with(text, str(rank.pid)).split()[:3] == [str(rank.rank), str(doc.node), str(rank.pid)]
    for tier in status.tiers:
        assert len([line for line in lines if re.search(rf"\b{tier.name} +{tier.step} ", line)]) == 1, text
    for event in status.events[-8:]:
        assert line_with(text, event.reason[:20]).split()[:2] == [str(event.gen), event.kind]


@pytest.mark.timeout(30)
def test_healthy_job():
    text = rendered(healthy())
    for node in (0, 1):
        assert "step 120 (g0)" in line_with(text, f"   {node}  running")
    crash = line_with(text, "rank 1 killed by SIGKILL at step 25")
    assert "step 20 RAM" in crash and crash.endswith("0.55s")
    assert "goodput 94.1%" in text and "2 nodes x 2" in text and "DEGRADED" not in text


@pytest.mark.timeout(30)
def test_lost_node_and_degraded_tier():
    status = lost_and_degraded()
    text = rendered(status)
    assert line_with(text, "   1  lost").split()[:2] == ["1", "lost"]
    assert "lost node(s): 1" in text.splitlines()[0]
    assert line_with(text, "disk  ").split()[-4:] == ["disk", "100", "42s", "DEGRADED"]
    assert text.splitlines()[1] == "disk tier DEGRADED: disk full: [Errno 28] No space left on device"
    console = Console(record=True, width=WIDTH, force_terminal=True)
    console.print(render(status, WIDTH))
    styled = console.export_html(inline_styles=True)
    assert "DEGRADED" in styled and "color: #800000" in styled  # red


@pytest.mark.timeout(30)
def test_restarting_job_with_rebuild():
    text = rendered(restarting_with_rebuild())
    assert text.startswith("job trebuild01  restarting  gen 10")
    assert line_with(text, "   1  rebuilding").split()[:5] == ["1", "rebuilding", "2", "2", "0B"]
    assert "failures (newest 8 of 10)" in text
    assert "trainer 1 killed" not in text  # generation 1's failure is older than the newest 8
    assert line_with(text, "node 1 lost").split()[-2:] == ["-", "-"]  # not agreed yet, not recovered yet


@pytest.mark.timeout(30)
def test_narrow_terminal_stacks_tables():
    text = rendered(lost_and_degraded(), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert line_with(text, "tiers").strip() == "tiers"  # no longer beside the nodes
    for pid in range(41000, 41004):
        line_with(text, str(pid))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("age, style", [(3.0, "green"), (18.0, "yellow"), (27.0, "bold red")])
def test_heartbeat_age_is_coloured_by_its_share_of_the_timeout(age, style):
    cell = beat(RankStatus(0, 1, 5, beat_age=age, timeout=30.0))
    assert cell.style == style and cell.plain.endswith("/30s")


@pytest.mark.timeout(30)
def test_plain_view_prints_once_a_second_without_escape_codes():
    out = io.StringIO()
    view = LiveView(Console(file=out, force_terminal=False, no_color=True, width=WIDTH), plain_interval=60)
    view.update(healthy())
    view.update(lost_and_degraded())  # within the interval: held back until close
    assert out.getvalue().count("job thealthy01") == 1 and "tlost00001" not in out.getvalue()
    view.close("job ended: done")
    text = out.getvalue()
    assert "\x1b" not in text and "job tlost00001" in text and text.rstrip().endswith("job ended: done")


# -- against real jobs ------------------------------------------------------------------------------------------

def ftrun_status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ftrun", "status", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def listening(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (for a failure message: a control store that refused connections
    in two CI runs while its job went on; not reproduced alone)."""
    try:
        connections = psutil.Process(pid).net_connections("tcp")
        return sorted(c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN)
    except psutil.Error:
        return []


def json_status(job_id: str, predicate, timeout: float = 90, pid: int | None = None) -> dict:
    """Poll ``ftrun status --job ID --json --once`` until the document satisfies ``predicate``; ``pid``: the job's
    launcher, whose listening ports a failure names."""
    deadline, last, error = time.monotonic() + timeout, None, ""
    while time.monotonic() < deadline:
        result = ftrun_status("--job", job_id, "--json", "--once")
        if result.returncode == 0:
            last = json.loads(result.stdout)
            if predicate(last):
                return last
        else:
            assert result.returncode == 2 and result.stderr.startswith("ftrun: error: "), result.stderr
            error = result.stderr.strip()
        time.sleep(0.2)
    ports = f"; its launcher listens on {listening(pid)}" if pid is not None else ""
    pytest.fail(f"no status of job {job_id} satisfied the check within {timeout}s; last: {last}; last error: {error}"
                f"{ports}")


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("ftrun: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""


def crash_job(start_job, tmp_path: Path, step_time: float = 0.1, steps: int = 100):
    """2 nodes x 1 trainer (EC on: one group with one parity); rank 1 crashes at step 25."""
    return start_job("--nnodes", "2", "--nproc-per-node", "1", "--inject", "crash@rank=1,step=25", str(TRAIN_GPT),
                     "--steps", str(steps), "--snapshot-every", "10", "--step-time", str(step_time),
                     "--out", str(tmp_path / "crash.hash"))


def recovered(doc: dict) -> bool:
    return doc["generation"] == 1 and bool(doc["events"]) and doc["events"][0]["seconds"] is not None


@pytest.mark.timeout(240)
def test_json_once_during_the_run_and_after_recovery(start_job, tmp_path):
    job = crash_job(start_job, tmp_path, steps=200)  # 20 s: status commands are slow on a loaded host
    running = json_status(job.job_id, lambda doc: len(doc["nodes"]) == 2, pid=job.proc.pid)
    assert running["job"] == job.job_id and running["nnodes"] == 2 and running["nproc_per_node"] == 1
    assert running["state"] in ("running", "restarting")
    assert {r["rank"] for doc in running["nodes"].values() for r in doc["ranks"]} == {0, 1}
    assert_one_line_error(ftrun_status("--job", "no-such-job", "--json", "--once"), "no running job 'no-such-job'")
    endpoint = json.loads(Path(shm_dir(), f"ftrun-{job.job_id}-launcher").read_text())["endpoint"]
    unknown = ftrun_status("--endpoint", endpoint, "--job", "no-such-job", "--once")
    assert f"no job 'no-such-job' at the control store {endpoint}" in unknown.stderr, (
        unknown.stderr, f"the launcher listens on {listening(job.proc.pid)}")
    assert_one_line_error(unknown)

    after = json_status(job.job_id, lambda doc: recovered(doc) and doc["state"] in ("running", "done")
                        and doc["tiers"][0]["step"] and doc["tiers"][0]["step"] > 20, pid=job.proc.pid)  # done: slow
    assert after["generation"] == 1 and after["restarts"] == 1
    event = after["events"][0]
    assert event["kind"] == "crash" and event["failed_step"] == 25 and "rank 1" in event["reason"]
    step, source = event["restored"]
    assert step in (10, 20) and "RAM" in source
    assert all(doc["committed"] > 0 for doc in after["nodes"].values())
    assert after["protected"]["0"] > 0  # EC on (2 nodes: one group, one parity)
    assert [tier["name"] for tier in after["tiers"]][:2] == ["RAM", "EC parity"]
    assert 0 < after["goodput"] <= 1
    assert job.wait(180) == 0, job.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, fragments", [
    (["--endpoint", "127.0.0.1:{port}", "--job", "x"], ["control store at 127.0.0.1:{port} is unreachable"]),
    (["--endpoint", "127.0.0.1:{port}"], ["--job is needed with --endpoint"]),
    (["--endpoint", "nohostport", "--job", "x"], ["--endpoint must be HOST:PORT"]),
    (["--job", "no-such-job-{port}", "--once"], ["no running job 'no-such-job-{port}' found on this host"]),
])
def test_bad_input_is_one_line(args, fragments):
    port = str(free_port())
    result = ftrun_status(*(arg.replace("{port}", port) for arg in args))
    assert_one_line_error(result, *(fragment.replace("{port}", port) for fragment in fragments))


@pytest.mark.timeout(60)
def test_inside_a_slurm_job_status_defaults_to_that_jobs_ftrun_job(tmp_path):
    """``srun --overlap --jobid 77 ftrun status`` (or the batch script) on a host where other jobs run too: was
    "several jobs run on this host ...: choose one with --job"; now the SLURM job's own, ``slurm-77``."""
    ports = {job: free_port() for job in ("slurm-77", "other")}
    for job, port in ports.items():  # launcher files of two live jobs (this process), at unreachable stores
        (tmp_path / f"ftrun-{job}-launcher").write_text(json.dumps(
            {"job": job, "endpoint": f"127.0.0.1:{port}", "backend": "c10d", "nnodes": 1, "pid": os.getpid()}))
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    env["FTRUN_SHM_DIR"] = str(tmp_path)

    def status(**slurm: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ftrun", "status", "--once"], capture_output=True, text=True,
                              timeout=30, cwd=ROOT, env={**env, **slurm})

    assert_one_line_error(status(SLURM_JOB_ID="77"), f"control store at 127.0.0.1:{ports['slurm-77']} is unreachable")
    assert_one_line_error(status(SLURM_JOB_ID="78"), "several jobs run on this host")  # not the SLURM job's
    assert_one_line_error(status(), "several jobs run on this host")


@pytest.mark.extended  # make test: the json view during the run and after recovery
@pytest.mark.timeout(240)
def test_ended_job_at_a_standalone_store(start_job, tmp_path):
    """With an ``ftrun store`` that outlives the job, ``--once`` and the live view still answer after it ended."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--port", str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert "listening" in store.stdout.readline()
        endpoint = f"127.0.0.1:{port}"
        job = start_job("--nnodes", "1", "--node-rank", "0", "--rdzv-endpoint", endpoint, "--nproc-per-node", "1",
                        str(TRAIN_GPT), "--steps", "20", "--snapshot-every", "10", "--out", str(tmp_path / "h"))
        assert job.wait(180) == 0, job.output
        once = ftrun_status("--endpoint", endpoint, "--job", job.job_id, "--json", "--once")
        assert once.returncode == 0, once.stderr
        doc = json.loads(once.stdout)
        assert doc["state"] == "done" and doc["nnodes"] == 1 and doc["generation"] == 0 and doc["restarts"] == 0
        live = ftrun_status("--endpoint", endpoint, "--job", job.job_id)  # stdout is a pipe: plain text
        assert live.returncode == 0, live.stderr
        assert "\x1b" not in live.stdout and live.stdout.startswith(f"job {job.job_id}  done")
        assert line_with(live.stdout, "   0  done").split()[:3] == ["0", "done", "0"]
        assert live.stdout.rstrip().splitlines()[-1] == "job ended: done"
    finally:
        os.killpg(store.pid, signal.SIGKILL)
        store.wait(10)


# -- the live view in a real terminal ------------------------------------------------------------------------------

@pytest.fixture
def tmux():
    """Run a command in a detached tmux session of 100x30 on a private server; ``capture()`` reads its screen."""
    if shutil.which("tmux") is None:
        problem = apt_install("tmux", timeout=300)
        if shutil.which("tmux") is None:
            pytest.skip(f"tmux is not installed and {problem or 'apt-get install tmux gave no tmux'}")
    socket = f"ftrun-test-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # the pane's size, not ours

    class Session:
        def start(self, command: str) -> None:
            subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "view", "-x", str(WIDTH), "-y",
                            str(HEIGHT), command], check=True, timeout=30, cwd=ROOT, env=env)

        def capture(self) -> str:
            return subprocess.run(["tmux", "-L", socket, "capture-pane", "-p", "-t", "view"], capture_output=True,
                                  text=True, timeout=30).stdout

        def wait_for(self, predicate, timeout: float, what: str) -> str:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                screen = self.capture()
                if predicate(screen):
                    return screen
                time.sleep(0.2)
            pytest.fail(f"{what} not on the screen within {timeout}s:\n{self.capture()}")

    try:
        yield Session()
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=30)


@pytest.mark.extended  # make test: the --tui view in the launcher's terminal
@pytest.mark.timeout(240)
def test_live_view_in_a_terminal(start_job, tmp_path, tmux):
    job = crash_job(start_job, tmp_path, step_time=0.15, steps=60)
    tmux.start(f"{sys.executable} -m ftrun status --job {job.job_id} --wait; sleep 120")
    tables = ("nodes", "tiers", "ranks", "failures", "EC parity", "heartbeat")
    screen = tmux.wait_for(lambda s: all(t in s for t in tables) and "   1  running" in s, 90, "the running job")
    assert line_with(screen, f"job {job.job_id}  ").startswith(f"job {job.job_id}  running  gen 0")
    assert line_with(screen, "tiers").split() == ["nodes", "tiers"]  # side by side at 100 columns
    screen = tmux.wait_for(lambda s: "rank 1 killed by SIGKILL" in s, 90, "the crash in the failures table")
    assert "gen 1  " in line_with(screen, f"job {job.job_id}  ") and "restarts 1" in screen
    screen = tmux.wait_for(lambda s: "step 20 RAM" in s or "step 10 RAM" in s, 30, "the restore step")
    assert all(len(line) <= WIDTH for line in screen.splitlines())
    assert job.wait(180) == 0, job.output
    screen = tmux.wait_for(lambda s: "job ended: done" in s, 30, "the end of the job")
    assert "rank 1 killed by SIGKILL at step 25" in screen


@pytest.mark.extended  # make test: test_json_once_during_the_run_and_after_recovery, the view unit tests
@pytest.mark.timeout(240)
def test_run_tui_shows_the_view_in_the_launchers_terminal_and_leaves_the_summary(tmp_path, tmux):
    job_id, out = f"t{uuid.uuid4().hex[:10]}", tmp_path / "tui.hash"
    tmux.start(f"{sys.executable} -m ftrun --tui --rdzv-id {job_id} --log-dir {tmp_path / 'logs'} --nnodes 2 "
               f"--nproc-per-node 1 --inject crash@rank=1,step=25 {TRAIN_GPT} --steps 60 --step-time 0.1 "
               f"--out {out}; sleep 120")
    try:
        screen = tmux.wait_for(lambda s: all(t in s for t in ("nodes", "tiers", "ranks")), 90, "the tables")
        assert f"job {job_id}  " in screen and "[node 0]" not in screen  # the view, not event lines
        screen = tmux.wait_for(lambda s: "rank 1 killed by SIGKILL" in s, 90, "the crash in the failures table")
        assert "restarts 1" in screen
        screen = tmux.wait_for(lambda s: "job ended: done" in s and "failures and recoveries" in s, 120,
                               "the final summary")
        assert f"ftrun: job {job_id} succeeded: 1 failure(s), 1 restart(s)" in screen
        assert (tmp_path / "logs" / "node0.log").exists()  # the nodes' and trainers' output went there
    finally:
        for proc in job_processes(job_id):
            proc.kill()
        for path in job_segments(job_id):
            os.unlink(path)


@pytest.mark.timeout(30)
def test_a_reason_that_looks_like_markup_is_shown_as_written():
    """Reasons quote trainers' error messages; gloo's start with "[/path/pair.cc:537]", which rich would read as a
    closing markup tag (and raise)."""
    reason = "rank 3 exited with code 1 (RuntimeError: [/__w/gloo/pair.cc:537] Read error [bold])"
    crash = Recovery(1, "crash", reason, "waitpid", 0.4, (20, "RAM"), 23)
    status = JobStatus("tmarkup001", 2, 2, "running", 1, 60.0, 1, 0.9, {n: node_doc(n, gen=1) for n in range(2)}, [],
                       {0: 120}, tiers(), [crash])
    assert "[/__w/gloo/pair.cc:537]" in rendered(status, 200)
