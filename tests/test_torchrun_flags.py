"""torchrun's flags under ftrun: every option ``torchrun --help`` lists (read at test time) parses with ftrun, and
the few that cannot apply are refused in one line; the ones with a meaning work in real runs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import typer

from conftest import SCRIPTS, TRAIN_PLAIN, assert_job_left_nothing, free_port, restores, run_bitwise
from ftrun.cli import TORCHRUN_OPTIONS, app, main, written_out
from ftrun.launch.config import build_config
from ftrun.errors import UsageError
from ftrun.launch.env import TrainerPlace, trainer_env
from ftrun.launch.output import parse_streams, split_filters

HELLO = str(SCRIPTS / "hello.py")
# torchrun flags that do not apply to ftrun: each exits 2 with one line that says why and what to use instead
REFUSED = {"--logs-specs": "use --log-dir", "--logs_specs": "use --log-dir",
           "--numa-binding": "numactl", "--numa_binding": "numactl"}


def torchrun_help() -> dict[str, str | None]:
    """Every option string of `torchrun --help` -> its metavar (None: a flag without a value)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    options: dict[str, str | None] = {}
    for line in result.stdout.splitlines():
        head = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if head is None:
            continue
        for item in head.group(1).split(", "):
            name, _, metavar = item.partition(" ")
            options[name] = metavar or None
    return options


def run_command():
    return typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]


def sample_value(metavar: str) -> str:
    choices = re.match(r"^\{([^}]*)\}$", metavar)
    return choices.group(1).split(",")[0] if choices else "1"


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("ftrun: error: "), err
    return err[0]


@pytest.mark.timeout(120)
def test_every_torchrun_flag_is_known_to_ftrun(capsys):
    options = torchrun_help()
    assert {"--nnodes", "--master-port", "--master_addr", "-r", "--tee", "--signals-to-handle",
            "--virtual-local-rank", "--run-path"} <= set(options), options  # the help was read
    command = run_command()
    params = {name: param for param in command.params for name in (*param.opts, *param.secondary_opts)}
    unknown = [name for name in options if name not in params and name not in ("-h", "--help")]
    assert not unknown, f"torchrun flags ftrun does not know: {unknown}"
    for name, metavar in options.items():
        if name in ("-h", "--help"):
            continue
        param = params[name]
        assert param.is_flag == (metavar is None), f"{name}: a flag in one, taking a value in the other"
        argv = [name] if metavar is None else [name, sample_value(metavar)]
        ctx = command.make_context("run", [*argv, "script.py", "--script-arg"])  # a flag ftrun lacks raises here
        assert ctx.params[param.name] is not None, name
        assert (ctx.params["script"], list(ctx.params["script_args"])) == ("script.py", ["--script-arg"]), name
        if name in REFUSED:
            assert REFUSED[name] in one_line_error(capsys, [*argv, HELLO])
    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as exited:
            main([flag])
        assert exited.value.code == 0 and "--master-port" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_torchrun_s_abbreviations_of_its_flags_are_read_as_torchrun_reads_them(capsys):
    """torchrun's argparse takes a unique prefix of a flag for it (``--nnode``, ``--nproc_per=2``, ``--stand``);
    a prefix of several is an error there ("ambiguous option"). ftrun's own flags are not abbreviated."""
    assert set(TORCHRUN_OPTIONS) == {name for name in torchrun_help() if name.startswith("--")}
    args = ["run", "--nnode", "2", "--nproc_per=3", "--rdzv-i", "x.py", "--stand", "x.py", "--nnode", "--stand"]
    assert written_out(args) == ["run", "--nnodes", "2", "--nproc_per_node=3", "--rdzv-id", "x.py", "--standalone",
                                 "x.py", "--nnode", "--stand"]  # the script's own arguments are its own
    ctx = run_command().make_context("run", written_out(args)[1:])
    assert (ctx.params["nnodes"], ctx.params["nproc_per_node"], ctx.params["rdzv_id"]) == ("2", "3", "x.py")
    assert ctx.params["standalone"] and ctx.params["script"] == "x.py"
    assert "ambiguous option: --max could match --max-restarts, --max_restarts" in one_line_error(capsys, [
        "--max", "1", HELLO])
    assert "No such option: --standb" in one_line_error(capsys, ["--standb", HELLO])  # ftrun's --standby


def test_every_torchrun_flag_read_from_its_pet_variable_is_read_from_it_by_ftrun_too():
    """torchrun takes each flag from ``PET_<FLAG>`` when it is not on the command line (Kubeflow's PyTorchJob and
    TorchX start nodes that way); without them, every pod of a job trained alone as a world of its own."""
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    theirs = {action.option_strings[0]: f"PET_{action.dest.upper()}" for action in get_args_parser()._actions
              if isinstance(action, (env, check_env))}
    assert {"--nnodes", "--node-rank", "--master-addr", "--standalone"} <= set(theirs), theirs
    params = {name: param for param in run_command().params for name in param.opts}
    assert {name: params[name].envvar for name in theirs} == theirs


@pytest.mark.timeout(150)
def test_pet_variables_alone_make_two_launchers_one_job(start_job, tmp_path):
    port, job_id = free_port(), f"t{uuid.uuid4().hex[:10]}"
    nodes = [start_job(HELLO, "--allreduce", job_id=job_id, log_dir=tmp_path / f"node{rank}",
                       env={"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
                            "PET_MASTER_PORT": str(port), "PET_NPROC_PER_NODE": "1", "PET_MAX_RESTARTS": "0"})
             for rank in (0, 1)]
    for job in nodes:
        assert job.wait(120) == 0, job.output
        assert "sum 3 world 2" in job.output and f"control store 127.0.0.1:{port}" in job.output
    assert_job_left_nothing(nodes[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, fragment", [
    (["--redirects", "7"], "--redirects must be 0, 1 (stdout), 2 (stderr) or 3 (both)"),
    (["-t", "0:4"], "--tee must be"),
    (["--rdzv-conf", "bogus=1"], "unknown --rdzv-conf key 'bogus' for --rdzv-backend c10d/static (known: "),
    (["--rdzv-conf", "join_timeout=soon"], "join_timeout must be a positive number"),
    (["--rdzv-conf", "store_type=file"], "store_type=file"),
    (["--nnodes", "3:2"], "--nnodes 3:2: MIN must be at least 1 and at most MAX"),
    (["--nnodes", "1:2:3"], "Invalid value for '--nnodes': '1:2:3' is not N or MIN:MAX"),
    (["--nproc-per-node", "lots"], "--nproc-per-node must be a number or auto, cpu, gpu, xpu"),
    (["--local-ranks-filter", "zero"], "--local-ranks-filter must be a comma-separated list"),
    (["--start-method", "thread"], "--start-method must be one of spawn, fork, forkserver"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE"], "unknown signal 'SIGNOPE'"),
    (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot stop a job"),
    (["--event-log-handler", "kafka"], "--event-log-handler 'kafka'"),
    (["--master-port", "70000"], "--master-port must be a port"),
    (["--monitor-interval", "0"], "--monitor-interval must be a positive number"),
    (["--monitor-interval", "nan"], "--monitor-interval must be a positive number of at most 1e+07, got nan"),
    (["--hang-timeout", "nan"], "--hang-timeout must be a positive number"),
    (["--node-timeout", "inf"], "--node-timeout must be a positive number"),
    (["--rdzv-conf", "join_timeout=nan"], "--rdzv-conf join_timeout must be a positive number"),
])
def test_bad_torchrun_values_are_one_line_errors(capsys, argv, fragment):
    assert fragment in one_line_error(capsys, [*argv, HELLO])


def test_torchrun_settings_map_onto_ftrun():
    cfg = build_config(None, {"nnodes": "1:4", "rdzv_conf": "join_timeout=20,keep_alive_interval=2,read_timeout=9,"
                              "last_call_timeout=1,close_timeout=1,use_libuv=0,is_host=1,store_type=tcp"})
    assert (cfg.min_nnodes, cfg.nnodes, cfg.rdzv_timeout, cfg.node_timeout) == (1, 4, 20.0, 6.0)
    assert build_config(None, {"rdzv_conf": "timeout=30"}).rdzv_timeout == 30.0
    # an empty --rdzv-endpoint (torchrun's default, a wrapper's unset variable) is none, not a bad HOST:PORT
    assert build_config(None, {"rdzv_endpoint": ""}).local_mode
    assert build_config(None, {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": " "}).rdzv_endpoint == "127.0.0.1:29500"
    # static rendezvous: --node-rank alone is node 0 at 127.0.0.1:29500, --master-* say otherwise
    assert build_config(None, {"nnodes": 2, "node_rank": 1}).rdzv_endpoint == "127.0.0.1:29500"
    multi = build_config(None, {"nnodes": 2, "node_rank": 0, "master_addr": "h", "master_port": 1234})
    assert (multi.node_rank, multi.rdzv_endpoint) == (0, "h:1234")
    single = build_config(None, {"nnodes": 1, "node_rank": 0})  # as torchrun: a local store on a free port
    assert (single.local_mode, single.rdzv_endpoint) == (True, None)
    # an endpoint without a port: torchrun's default ports (c10d 29400, etcd 2379)
    assert build_config(None, {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0"}).rdzv_endpoint == "node0:29400"
    assert build_config(None, {"rdzv_endpoint": "[::1]"}).rdzv_endpoint == "[::1]:29400"
    assert build_config(None, {"rdzv_backend": "etcd", "rdzv_endpoint": "e1,e2:2380"}).rdzv_endpoint == \
        "e1:2379,e2:2380"
    assert build_config(None, {"master_port": 29555}).rdzv_endpoint == "127.0.0.1:29555"  # the local store's
    assert build_config(None, {"start_method": "spawn"}).zygote is False
    assert build_config(None, {"start_method": "fork", "zygote": False}).zygote is True
    run_path = build_config(None, {"run_path": True, "module": True, "no_python": True})
    assert (run_path.module, run_path.no_python) == (False, False)
    assert build_config(None, {"nproc_per_node": "cpu"}).nproc_per_node >= 1
    assert [s.name for s in build_config(None, {"signals_to_handle": "SIGTERM,SIGUSR1"}).signals] == \
        ["SIGTERM", "SIGUSR1"]
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES=3 names 1 device"):
        build_config(None, {"nproc_per_node": 2, "virtual_local_rank": True}, env={"CUDA_VISIBLE_DEVICES": "3"})
    ctx = run_command().make_context("run", ["--shutdown-timeout", "7", "script.py"])
    assert ctx.params["stop_grace"] == 7.0


def test_stream_values_and_filters_parse_as_torchrun():
    assert parse_streams("3", "--tee") == 3
    assert parse_streams("0:1,1:2,12:3", "--tee") == {0: 1, 1: 2, 12: 3}
    assert split_filters("apple,orange,,pear") == ["apple", "orange,pear"]
    assert split_filters("") == []


def test_role_signals_and_virtual_local_rank_in_the_trainer_env():
    place = TrainerPlace("job", 0, 1, 1, 2, 0, 3, "127.0.0.1", 1)
    common = dict(omp_threads=1, heartbeat_file="hb", keeper_socket="k", error_file="e", faults="")
    env = trainer_env({"CUDA_VISIBLE_DEVICES": "3,5"}, place, role="trainer", signals_to_handle="SIGTERM,SIGUSR1",
                      virtual_local_rank=True, **common)
    assert (env["ROLE_NAME"], env["TORCHELASTIC_SIGNALS_TO_HANDLE"]) == ("trainer", "SIGTERM,SIGUSR1")
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"], env["RANK"]) == ("0", "5", "1")
    plain = trainer_env({}, place, **common)
    assert (plain["LOCAL_RANK"], plain["ROLE_NAME"], "CUDA_VISIBLE_DEVICES" in plain) == ("1", "default", False)
    assert plain["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


# -- real runs ----------------------------------------------------------------------------------------------------

def trainer_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"(hello|err) from rank", line)]


@pytest.mark.timeout(120)
def test_an_endpoint_on_port_0_hosts_the_store_of_a_job_of_this_host_on_a_free_port(start_job):
    job = start_job("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--nnodes", "1", HELLO)
    assert job.wait(90) == 0, job.output
    store = re.search(r"control store 127\.0\.0\.1:(\d+)", job.output)
    assert store is not None and int(store.group(1)) > 0, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_a_long_monitor_interval_does_not_delay_failure_detection(start_job, tmp_path):
    """Scripts written for older torch pass ``--monitor-interval 5`` (torchrun's agent polls its workers that
    often): a supervisor's looks also do its checks, and each waited that long at least, so a hang at
    --hang-timeout 2 went unseen for minutes with --monitor-interval 20. Above a quarter second it acts as one."""
    job = start_job("--nproc-per-node", "2", "--monitor-interval", "3600", "--hang-timeout", "2",
                    "--inject", "hang@rank=1,step=7", str(TRAIN_PLAIN), "--steps", "10", "--step-time", "0.1",
                    "--ckpt-dir", str(tmp_path / "ck"))
    assert job.wait(90) == 0, job.output
    assert "rank 1 hung" in job.output and "succeeded: 1 failure(s), 1 restart(s)" in job.output, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_node_rank_0_of_1_runs_without_an_endpoint(start_job):
    job = start_job("--node-rank", "0", "--nnodes", "1", "--role", "worker", HELLO)
    assert job.wait(90) == 0, job.output
    assert "hello from rank 0 role worker" in job.output
    assert "(local)" in job.output  # as torchrun: a local store on a free port, not 127.0.0.1:29500
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_a_directory_runs_its_main_as_python_does(start_job, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import os, sys\n"
                                     "print(f'hello from rank {os.environ[\"RANK\"]} {sys.argv[1:]} {sys.path[0]}')\n")
    job = start_job("--nproc-per-node", "2", "app", "--", "--flag", "1", "--", "x")  # torchrun drops the first --
    assert job.wait(90) == 0, job.output
    for rank in (0, 1):
        assert f"hello from rank {rank} ['--flag', '1', '--', 'x'] {app}" in job.output, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_the_local_rank_macro_in_the_script_s_arguments_is_each_trainer_s_local_rank(start_job, tmp_path):
    """torchrun replaces ``${local_rank}`` in the script's arguments (``--local_rank=${local_rank}``, scripts of
    torch.distributed.launch's days): before, ftrun passed the text itself, and ``type=int`` refused it."""
    script = tmp_path / "args.py"
    script.write_text("import os, sys\n"  # one write: two trainers' lines interleaved word by word in a CI run
                      "sys.stdout.write(f\"hello from rank {os.environ['RANK']} {sys.argv[1:]}\\n\")\n")
    job = start_job("--nnodes", "2", "--nproc-per-node", "2", str(script), "--local_rank=${local_rank}",
                    "out_${local_rank}_$${local_rank}_${rank}")
    assert job.wait(90) == 0, job.output
    for rank in range(4):  # local ranks 0, 1 on both nodes; $$ is a $ and other names are kept, as torchrun's
        assert (f"hello from rank {rank} ['--local_rank={rank % 2}', 'out_{rank % 2}_${{local_rank}}_${{rank}}']"
                in job.output), job.output


@pytest.mark.timeout(120)
def test_local_addr_is_taken_by_a_job_of_this_host_alone(start_job):
    """Cluster wrappers pass --local-addr $(hostname -i) to every torchrun: refused before in local mode."""
    job = start_job("--standalone", "--local-addr", "192.0.2.250", "--nproc-per-node", "2", HELLO, "--allreduce")
    assert job.wait(90) == 0, job.output
    assert "sum 3 world 2" in job.output


@pytest.mark.timeout(150)
def test_master_addr_and_port_join_two_launchers(start_job, tmp_path):
    port, job_id = free_port(), f"t{uuid.uuid4().hex[:10]}"
    node0 = start_job("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
                      HELLO, "--allreduce", job_id=job_id, log_dir=tmp_path / "node0")
    node1 = start_job("--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                      HELLO, "--allreduce", job_id=job_id, log_dir=tmp_path / "node1")
    for job in (node0, node1):
        assert job.wait(120) == 0, job.output
        assert "sum 3 world 2" in job.output and f"control store 127.0.0.1:{port}" in job.output
    assert_job_left_nothing(node0)


@pytest.mark.timeout(120)
def test_tee_with_filter_and_labels(start_job, tmp_path):
    log_dir = tmp_path / "logs"
    job = start_job("--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "0", "--label-output",
                    "--duplicate-stdout-filters", "hello,,x,role", HELLO, log_dir=log_dir)
    assert job.wait(90) == 0, job.output
    lines = trainer_lines(job.output)
    assert sorted(lines) == ["[rank 0] err from rank 0", "[rank 0] hello from rank 0 role default"], job.output
    for rank in (0, 1):
        files = log_dir / "gen0" / f"rank{rank}"
        assert (files / "stdout.log").read_text() == f"hello from rank {rank} role default\n"
        assert (files / "stderr.log").read_text() == f"err from rank {rank}\n"
    # lines shown on the console that contain a filter ("hello,x" or "role"), as shown
    filtered = log_dir / "gen0" / "node0" / "filtered_stdout.log"
    assert filtered.read_text() == "[rank 0] hello from rank 0 role default\n"
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_redirects_keep_the_console_clean_also_with_spawn(start_job, tmp_path):
    log_dir = tmp_path / "logs"
    job = start_job("--nproc-per-node", "2", "-r", "3", "--start-method", "spawn", HELLO, log_dir=log_dir)
    assert job.wait(90) == 0, job.output
    assert trainer_lines(job.output) == [], job.output
    assert "as new processes" in job.output  # --start-method spawn: no zygote
    for rank in (0, 1):
        assert (log_dir / "gen0" / f"rank{rank}" / "stdout.log").read_text().startswith(f"hello from rank {rank}")
        assert (log_dir / "gen0" / f"rank{rank}" / "stderr.log").read_text() == f"err from rank {rank}\n"
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_job_with_exit_code_130(start_job):
    """SIGINT to the launcher's process group, as a terminal's Ctrl-C: every node stops, each says why."""
    job = start_job("--nnodes", "2", "--label-output", HELLO, "--wait-usr1")
    deadline = time.monotonic() + 60
    while not ("[rank 0] ready 0" in job.output and "[rank 1] ready 1" in job.output):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.05)
    os.killpg(job.proc.pid, signal.SIGINT)
    assert job.wait(60) == 130, job.output
    assert "supervisor got SIGINT: every node stops its trainers" in job.output, job.output
    assert "stopped by a signal (exit code 130)" in job.output, job.output
    for rank in (0, 1):  # relayed as SIGINT, as torchrun does: scripts see KeyboardInterrupt, their finally runs
        assert f"[rank {rank}] KeyboardInterrupt in rank {rank}" in job.output, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_a_node_stopped_by_sigint_stops_every_node_s_trainers_with_sigint(start_job):
    """Only node 1's supervisor gets SIGINT (as a multi-node job's node whose terminal pressed Ctrl-C): node 0
    learns of the stop from the generation, and relays the same signal."""
    job = start_job("--nnodes", "2", "--label-output", HELLO, "--wait-usr1")
    deadline = time.monotonic() + 60
    while not ("[rank 0] ready 0" in job.output and "[rank 1] ready 1" in job.output):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.05)
    node1 = job.wait_for_event(lambda e: e["event"] == "node_start" and e.get("node") == 1)
    os.kill(node1["pid"], signal.SIGINT)
    job.wait(60)
    assert "node 1's supervisor got SIGINT: every node stops its trainers" in job.output, job.output
    for rank in (0, 1):
        assert f"[rank {rank}] KeyboardInterrupt in rank {rank}" in job.output, job.output
    assert_job_left_nothing(job)


def wait_for_output(job, *lines: str, timeout: float = 60) -> None:
    """Until every one of ``lines`` is in the job's output (it must not end before)."""
    deadline = time.monotonic() + timeout
    while not all(line in job.output for line in lines):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_sigusr1_reaches_every_trainer_and_sighup_stops_the_job(start_job):
    job = start_job("--nnodes", "2", "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGUSR1", "--label-output",
                    HELLO, "--wait-usr1")
    wait_for_output(job, "[rank 0] ready 0", "[rank 1] ready 1")
    os.kill(job.proc.pid, signal.SIGUSR1)
    wait_for_output(job, "got SIGUSR1 in rank 0", "got SIGUSR1 in rank 1")
    os.kill(job.proc.pid, signal.SIGHUP)
    assert job.wait(60) == 128 + signal.SIGHUP, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_sigusr1_not_listed_to_every_process_of_the_job_is_ignored_by_ftrun_in_one_line(start_job):
    """SLURM's ``--signal=USR1@90`` reaches every process of a step. Without SIGUSR1 in --signals-to-handle the
    launcher died of it (its default action), the supervisors with it, and the job; now ftrun's own processes
    ignore it, the launcher in one line, and the trainers get it."""
    job = start_job("--nnodes", "2", "--label-output", HELLO, "--wait-usr1")
    wait_for_output(job, "[rank 0] ready 0", "[rank 1] ready 1")
    launcher = psutil.Process(job.proc.pid)
    for proc in [launcher, *launcher.children(recursive=True)]:  # supervisors, keepers, zygotes, trainers
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)
    wait_for_output(job, "got SIGUSR1 in rank 0", "got SIGUSR1 in rank 1",
                    "SIGUSR1 ignored: not in --signals-to-handle (list it there to pass it on to the trainers)")
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(60) == 128 + signal.SIGTERM, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_a_rerun_with_the_same_log_dir_keeps_the_earlier_run_s_logs_apart(start_job, tmp_path):
    """As torchrun keeps each run's logs in a directory of its own: the earlier run's trainer files move to
    previous-<time>/, and its error file is never taken for the cause of this run's failure."""
    log_dir = tmp_path / "logs"
    first_script = tmp_path / "first.py"
    first_script.write_text('print("first run", flush=True)\nraise ValueError("from the first run")\n')
    first = start_job("--max-restarts", "0", "--redirects", "3", str(first_script), log_dir=log_dir)
    assert first.wait(90) == 3, first.output
    assert (log_dir / "gen0" / "rank0" / "error.json").exists()
    second_script = tmp_path / "second.py"
    second_script.write_text('import os, signal\nprint("second run", flush=True)\n'
                             'os.kill(os.getpid(), signal.SIGKILL)\n')
    second = start_job("--max-restarts", "0", "--redirects", "3", str(second_script), log_dir=log_dir)
    assert second.wait(90) == 3, second.output
    failure = [e for e in second.events() if e["event"] == "failure"][-1]
    assert "SIGKILL" in failure["message"] and "first run" not in failure["message"], failure
    assert (log_dir / "gen0" / "rank0" / "stdout.log").read_text() == "second run\n"
    earlier = list(log_dir.glob("previous-*/gen0/rank0"))
    assert len(earlier) == 1 and (earlier[0] / "stdout.log").read_text() == "first run\n"
    assert "from the first run" in (earlier[0] / "error.json").read_text()
    assert_job_left_nothing(second)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variable, value, fragment", [
    ("PET_NNODES", "abc", "'abc' is not N or MIN:MAX (--nnodes from PET_NNODES='abc')"),
    ("PET_MAX_RESTARTS", "-1", "got -1 (--max-restarts from PET_MAX_RESTARTS='-1')"),
    ("PET_NODE_RANK", "3", "(--node-rank from PET_NODE_RANK='3')"),
])
def test_a_bad_value_from_a_pet_variable_names_the_variable(capsys, monkeypatch, variable, value, fragment):
    """Kubeflow and TorchX pass flags as PET_* variables: the command line shows no such value, so the error
    names where it came from; a flag on the command line wins and is named alone."""
    monkeypatch.setenv(variable, value)
    assert fragment in one_line_error(capsys, [HELLO])
    flag = "--" + variable[4:].lower().replace("_", "-")
    assert "PET_" not in one_line_error(capsys, [flag, "-2", HELLO])


@pytest.mark.timeout(300)
def test_virtual_local_rank_trainers_keep_snapshots_of_their_own_and_resume_bitwise(start_job, tmp_path,
                                                                                    gpt_baselines):
    """With --virtual-local-rank every trainer's LOCAL_RANK is 0, but each has slots of its own at the keeper: a
    crash restores the newest step from RAM (the second trainer held none before, so the job started over from
    step 0 and then waited for its snapshots for good) and the job ends bit-exact."""
    job = run_bitwise(start_job, tmp_path, gpt_baselines(1, 2), "virtual", "--inject", "crash@rank=1,step=35",
                      nodes=("--nproc-per-node", "2", "--virtual-local-rank"))
    plan = restores(job)[1]
    assert plan["restored_from"] == "ram" and plan["step"] >= 20, job.output
