"""Every trainer sees exactly torchrun's environment, with the same restart count on every node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from conftest import SCRIPTS, assert_job_left_nothing
from ftrun.control.spec import ENV_NODE_SPEC
from ftrun.launch.env import (TORCHRUN_VARIABLES, TRAINER_FTRUN_VARIABLES, TrainerPlace, gloo_interface, trainer_env,
                              trainer_threads)
from ftrun.snapshot.dcp_copy import ENV_DCP_ROOT


def read_dumps(directory) -> dict[tuple[int, int], dict]:
    dumps = {}
    for name in os.listdir(directory):
        gen, rank = name.removesuffix(".json").split("-")
        dumps[int(gen), int(rank)] = json.loads((directory / name).read_text())
    return dumps


@pytest.mark.timeout(120)
def test_environment_is_torchrun_contract_on_every_node_and_generation(start_job, tmp_path):
    dumps_dir = tmp_path / "dumps"
    dumps_dir.mkdir()
    job = start_job("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "2", str(SCRIPTS / "envdump.py"),
                    "--crash-gen0", env={"ENVDUMP_DIR": str(dumps_dir), "OMP_NUM_THREADS": ""})
    assert job.wait() == 0, job.output
    assert_job_left_nothing(job)
    dumps = read_dumps(dumps_dir)
    assert sorted(dumps) == [(g, r) for g in (0, 1) for r in range(4)]
    for (gen, rank), env in dumps.items():
        node, local = divmod(rank, 2)
        assert env["RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(local)
        assert env["GROUP_RANK"] == str(node)
        assert env["ROLE_NAME"] == "default"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "4"
        assert env["GROUP_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(gen)  # the same on both nodes
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == job.job_id
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"gen{gen}/rank{rank}/error.json")
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        # of ftrun's variables only the client's: no launcher internals (node spec, store address, secret); no
        # durable directory without --ckpt-dir
        assert {k for k in env["_all"] if k.startswith("FTRUN_")} == set(TRAINER_FTRUN_VARIABLES) - {ENV_DCP_ROOT}
        # ftrun's own processes keep torch's C++ warnings short; the trainers get the user's setting (none here)
        assert ("TORCH_CPP_LOG_LEVEL" in env["_all"]) == ("TORCH_CPP_LOG_LEVEL" in os.environ)
    # one trainer store per generation, shared by all ranks of it, on a new port each time
    ports = {gen: {dumps[gen, r]["MASTER_PORT"] for r in range(4)} for gen in (0, 1)}
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]
    # an empty OMP_NUM_THREADS counts as set by the user; unset, it is cores / trainers on this host
    assert dumps[0, 0]["OMP_NUM_THREADS"] == ""


# Where a trainer's environment differs from a torchrun worker's on purpose (README: torchrun's flags, the
# OMP_NUM_THREADS default; ftrun.launch.env): ftrun's client variables and GLOO_SOCKET_IFNAME are ftrun's alone;
# these torchrun variables name this run's own trainer store, run id and error file, or take ftrun's defaults
OWN_VARIABLES = {*TRAINER_FTRUN_VARIABLES, "GLOO_SOCKET_IFNAME"}
OWN_VALUES = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS"}
HARNESS = {"ENVDUMP_DIR", "PYTEST_CURRENT_TEST"}  # the test's own: a directory per run, pytest's phase
IMPORTED = ("KMP_DUPLICATE_LIB_OK", "TORCHINDUCTOR_CACHE_DIR")  # what imports write: this pytest process's too


def comparable(environ: dict[str, str]) -> dict[str, str]:
    """A trainer's environment without what differs between ftrun and torchrun on purpose, nor the test's own."""
    return {k: "(own)" if k in OWN_VALUES else v for k, v in environ.items() if k not in OWN_VARIABLES | HARNESS}


@pytest.fixture(scope="module")
def torchrun_env(tmp_path_factory) -> dict:
    """What rank 1 of real torchrun sees (``--standalone --nproc-per-node 2``), without OMP_NUM_THREADS set."""
    dumps = tmp_path_factory.mktemp("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", *IMPORTED)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "envdump.py")]
    subprocess.run(torchrun, env={**env, "ENVDUMP_DIR": str(dumps)}, check=True, timeout=90, capture_output=True)
    return read_dumps(dumps)[0, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, user", [((), False), (("--tui", "--no-zygote"), False), ((), True)],
                         ids=["zygote", "new-interpreters", "user-values"])
def test_omp_threads_default_and_same_environment_as_real_torchrun(start_job, tmp_path, monkeypatch, torchrun_env,
                                                                   flags, user):
    """The whole environment, not only torchrun's variables: trainers got what the launcher's own imports wrote
    (threadpoolctl's KMP_DUPLICATE_LIB_OK, and forked by the zygote, TORCHINDUCTOR_CACHE_DIR of the preloaded
    torch._dynamo), which torchrun's workers do not have. Trainers forked by the zygote of a supervisor forked by
    the launcher; trainers and supervisors started as new interpreters (--tui); a user's own values of both."""
    ours = tmp_path / "ftrun"
    ours.mkdir()
    for name in IMPORTED:  # as in a user's shell, not as another test module's imports left them here
        monkeypatch.delenv(name, raising=False)
    users = {"KMP_DUPLICATE_LIB_OK": "FALSE", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")} if user else {}
    job = start_job(*flags, "--nproc-per-node", "2", str(SCRIPTS / "envdump.py"),
                    env={"ENVDUMP_DIR": str(ours), **users})
    assert job.wait() == 0, job.output
    ftrun_env = read_dumps(ours)[0, 1]
    contract = [k for k in torchrun_env["_all"] if not k.startswith("FTRUN_")]
    assert [k for k in ftrun_env["_all"] if not k.startswith("FTRUN_")] == contract
    assert set(contract) == set(TORCHRUN_VARIABLES)
    assert comparable(ftrun_env["_environ"]) == comparable({**torchrun_env["_environ"], **users})
    expected_threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert ftrun_env["OMP_NUM_THREADS"] == str(expected_threads)
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_NAME", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        assert ftrun_env[name] == torchrun_env[name], name


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to run ftrun on fewer")
def test_omp_threads_default_counts_the_cores_ftrun_may_run_on_not_the_host_s(start_job, tmp_path):
    """A SLURM or container cpuset (here ``taskset``) gives ftrun fewer cores than the host has: each trainer's
    default OpenMP threads share those (before: all of the host's cores per trainer, oversubscribed)."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    job = start_job("--nproc-per-node", "1", str(SCRIPTS / "envdump.py"), env={**env, "ENVDUMP_DIR": str(dumps)},
                    prefix=("taskset", "-c", str(min(os.sched_getaffinity(0)))))
    assert job.wait() == 0, job.output
    assert read_dumps(dumps)[0, 0]["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("value, threads", [("3", 3), ("", None), ("abc", None), ("0", None), ("\u00b2", None),
                                           ("\u0661", None), ("99999999999999999999", None)])
def test_the_blas_is_sized_only_from_an_omp_num_threads_that_openmp_reads_as_a_number(value, threads):
    """A superscript digit (``str.isdigit`` but not ``int``) and a count beyond a C int (threadpoolctl's
    ``ctypes`` call overflows) ended the launcher in a traceback; OpenMP does not read either as a count."""
    assert trainer_threads({"OMP_NUM_THREADS": value}, 2) == threads


@pytest.mark.timeout(60)
def test_a_trainer_forked_by_the_zygote_runs_with_an_omp_num_threads_that_is_no_count(start_job):
    """The zygote sized torch's threads from it as ``int(value)`` after ``str.isdigit``: every trainer of a job with
    ``OMP_NUM_THREADS=²`` died in ftrun's traceback (exit 1, twice: the job failed). It runs as in a new
    interpreter, which reads no count there either."""
    job = start_job("--nproc-per-node", "1", str(SCRIPTS / "hello.py"), env={**os.environ, "OMP_NUM_THREADS": "\u00b2"})
    assert job.wait() == 0, job.output
    assert "hello from rank 0" in job.output


@pytest.mark.timeout(120)
def test_trainers_and_zygotes_carry_no_launcher_internals(start_job):
    """Not in what the script reads (above), nor in /proc/PID/environ of a trainer forked by the zygote (the
    zygote's exec environment; without a zygote it is the trainer's own, checked above): the node spec names the
    control store, the secret signs its values."""
    job = start_job("--nnodes", "2", "--nproc-per-node", "1", str(SCRIPTS / "sleeper.py"), "--seconds", "4")
    trainer = job.trainer(1)
    seen = trainer.environ()
    assert job.wait() == 0, job.output
    assert ENV_NODE_SPEC not in seen and "FTRUN_JOB_SECRET" not in seen, sorted(seen)
    assert seen["FTRUN_JOB_ID"] == job.job_id  # `ftrun clean` and the tests find a job's processes by it
    assert_job_left_nothing(job)


def test_gloo_binds_to_the_interface_holding_the_nodes_address():
    """Gloo otherwise binds to what the host name resolves to (127.0.1.1 on Debian), unreachable from other
    hosts: the node's own address picks the interface; a job on loopback gets the loopback interface; an
    address of no local interface leaves gloo's choice alone (the user's GLOO_SOCKET_IFNAME always wins)."""
    loopback = next(name for name, addresses in psutil.net_if_addrs().items()
                    if any(a.address == "127.0.0.1" for a in addresses))
    other = next(((name, a.address) for name, addresses in psutil.net_if_addrs().items() for a in addresses
                  if a.family.name == "AF_INET" and not a.address.startswith("127.")), None)
    assert gloo_interface("127.0.0.1", "127.0.0.1") == loopback
    assert gloo_interface("localhost", "127.0.0.1") == loopback
    assert gloo_interface("192.0.2.7", "192.0.2.1") is None  # TEST-NET: on no interface here
    assert gloo_interface("127.0.0.1", "192.0.2.1") is None  # a loopback node address with a remote master
    if other is not None:
        assert gloo_interface(other[1], "192.0.2.1") == other[0]
    place = TrainerPlace("j", 0, 2, 0, 1, 0, 0, "127.0.0.1", 1)
    common = dict(omp_threads=1, heartbeat_file="h", keeper_socket="k", error_file="e", faults="")
    assert trainer_env({}, place, **common)["GLOO_SOCKET_IFNAME"] == loopback
    assert trainer_env({"GLOO_SOCKET_IFNAME": "eth9"}, place, **common)["GLOO_SOCKET_IFNAME"] == "eth9"


CPP_WARNING = '''\
import datetime
import torch.distributed as dist
try:  # nothing listens on port 9: torch's C++ client logs a warning (retrying) before it gives up
    dist.TCPStore("127.0.0.1", 9, is_master=False, timeout=datetime.timedelta(seconds=0.3))
except Exception as err:
    print("raised", type(err).__name__, flush=True)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [(), ("--no-zygote",)], ids=["zygote", "new-interpreter"])
def test_trainers_print_torch_s_cpp_warnings_as_under_torchrun(start_job, tmp_path, flags):
    """ftrun's own processes run torch's C++ logging at ERROR (no C++ stacks before its one-line reports); a
    trainer, forked by the zygote or not, logs at the user's level (here torch's default, WARNING)."""
    script = tmp_path / "cpp_warning.py"
    script.write_text(CPP_WARNING)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    job = start_job(*flags, str(script), env=env)
    assert job.wait(90) == 0, job.output
    # "- retrying", or under load "- timed out (try=0, ...)": a C++ warning either way
    assert "raised DistNetworkError" in job.output and "failed to connect/validate to host 127.0.0.1:9 - " \
        in job.output, job.output
    assert_job_left_nothing(job)
