"""A trainer forked from the zygote runs a third-party script as ``python script.py`` under torchrun would,
though torch, numpy and ftrun's own modules are loaded before it: its randomness is its own, a module beside
the script shadows one loaded before it, ``__main__`` stays the script's module after it returns, numpy's
BLAS threads follow ``OMP_NUM_THREADS``, and no descriptor of ftrun's parent reaches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import assert_job_left_nothing
from ftrun.launch import as_main
from ftrun.launch.as_main import forget_shadowed

PROBE = '''\
import atexit, io, json, multiprocessing, os, sys, threading
import numpy, torch
from threadpoolctl import threadpool_info
import secrets, statistics                    # both beside this script, both loaded by ftrun before it
import ftrun


class State:
    def __init__(self):
        self.step = 7


def pickled(tag):
    torch.save(State(), io.BytesIO())         # finds __main__.State: this module is still __main__
    with open(os.path.join(OUT, f"{tag}-{os.environ['RANK']}-{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w"):
        pass


def link(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor
        return None


OUT = sys.argv[1]
record = {
    "seed": torch.initial_seed(), "numpy": int(numpy.random.randint(2**31)),
    "authkey": bytes(multiprocessing.current_process().authkey).hex(), "secrets": secrets.WHO,
    "statistics": statistics.WHO, "builtins_module": isinstance(__builtins__, type(sys)),
    "source": len(__loader__.get_source("__main__")), "file": __file__,
    "blas": [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"],
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "fds": [link(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2],
    "generation": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
}
print("PROBE " + json.dumps(record), flush=True)
atexit.register(pickled, "atexit")
threading.Thread(target=lambda: (__import__("time").sleep(0.3), pickled("thread"))).start()
for step in range(4):
    ftrun.heartbeat(step)
    __import__("time").sleep(0.2)
'''


def probes(output: str) -> list[dict]:
    return [json.loads(line.split("PROBE ", 1)[1]) for line in output.splitlines() if "PROBE " in line]


@pytest.mark.timeout(120)
def test_a_script_runs_in_a_zygote_trainer_as_in_a_new_interpreter(start_job, tmp_path):
    app, out = tmp_path / "app", tmp_path / "out"
    app.mkdir()
    out.mkdir()
    (app / "train.py").write_text(PROBE)
    (app / "secrets.py").write_text("WHO = 'beside the script'\n")
    (app / "statistics").mkdir()  # a package of the user's, beside the script
    (app / "statistics" / "__init__.py").write_text("WHO = 'package beside the script'\n")
    (app / "numpy").mkdir()  # no __init__.py: a namespace portion, which shadows nothing (as for python)
    inherited = os.open(tmp_path / "inherited", os.O_CREAT | os.O_WRONLY, 0o600)  # as a shell's extra descriptor
    job = start_job("--nproc-per-node", "2", "--max-restarts", "1", "--inject", "crash@rank=1,step=2",
                    str(app / "train.py"), str(out), pass_fds=(inherited,))
    os.close(inherited)
    assert job.wait(90) == 0, job.output
    found = probes(job.output)
    # 2 ranks x 2 generations (rank 0 of generation 0 may be stopped before it prints, on a loaded host)
    assert len(found) >= 3 and sum(probe["generation"] == 1 for probe in found) == 2, job.output
    for key in ("seed", "numpy", "authkey"):  # drawn anew by every trainer, as a new interpreter draws them
        assert len({probe[key] for probe in found}) == len(found), (key, found)
    for probe in found:
        assert probe["secrets"] == "beside the script" and probe["statistics"] == "package beside the script"
        assert probe["builtins_module"] and probe["source"] == len(PROBE) and probe["file"] == str(app / "train.py")
        # OMP_NUM_THREADS: the user's, else cores / trainers (1 here, where numpy's OpenBLAS was loaded with 2)
        assert probe["blas"] and set(probe["blas"]) == {int(probe["omp"])}, probe
        assert str(tmp_path / "inherited") not in probe["fds"], probe  # torchrun's trainers start with close_fds
    # generation 1 ran to its end: its atexit handler and its thread pickled a class of the script
    assert {p.name for p in out.iterdir() if p.name.endswith("-1")} == {
        f"{tag}-{rank}-1" for tag in ("atexit", "thread") for rank in (0, 1)}, job.output
    assert_job_left_nothing(job)


def run_bootstrap(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A --no-zygote trainer's bootstrap (the zygote's trainers run the same code)."""
    return subprocess.run([sys.executable, "-u", "-P", "-m", "ftrun.launch.bootstrap", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


SHOW = "import sys\nprint(__name__, __package__, __spec__ and __spec__.name, sys.argv, sys.path[0] == {!r})\n"


@pytest.mark.timeout(60)
def test_packages_zip_files_and_errors_run_as_python_runs_them(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(SHOW.format(str(tmp_path)))
    (package / "mod.py").write_text(SHOW.format(str(tmp_path)))
    (tmp_path / "nomain").mkdir()
    (tmp_path / "nomain" / "__init__.py").write_text("")
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as archive:
        archive.writestr("__main__.py", SHOW.format(str(tmp_path / "app.zip")))
    for args in (["-m", "pkg", "a"], ["-m", "pkg.mod", "b"], ["app.zip", "c"], ["-m", "nomain"],
                 ["-m", "pkg.missing"], ["-m", ".rel"]):
        expected = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        done = run_bootstrap(*args, cwd=tmp_path)
        assert (done.returncode, done.stdout, done.stderr) == (expected.returncode, expected.stdout,
                                                               expected.stderr), args


def test_only_modules_loaded_after_the_start_are_forgotten(tmp_path, monkeypatch):
    for name in ("json.py", "os.py", "torch.py"):  # loaded after the start; at the start; kept
        (tmp_path / name).write_text("")
    (tmp_path / "email").mkdir()  # a namespace portion: shadows nothing
    import email  # noqa: F401
    import json

    import torch  # noqa: F401

    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # forget in a copy: the test process keeps its own
    monkeypatch.setattr(as_main, "STARTUP_MODULES", frozenset({"os"}))  # pytest's start loaded json too
    assert forget_shadowed(str(tmp_path)) == ["json"]
    assert "json" not in sys.modules and "json.decoder" not in sys.modules
    assert sys.modules["os"] is not None and "torch" in sys.modules and "email" in sys.modules
    assert json.dumps(1) == "1"  # who imported it keeps it
    assert forget_shadowed(str(tmp_path / "missing")) == []


SETS_BEFORE_TORCH = '''\
"""A script that configures torch through its environment before importing it."""
import os, sys
from os import environ
import ftrun
os.environ["TORCH_LOGS"] = "graph_breaks"
if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    environ.update({"TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "NCCL_DEBUG": "INFO"}, MKL_NUM_THREADS="1")
os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"     # read when the process group starts: not at import
os.environ["TMPDIR"] = "/tmp"                    # the launcher's value: changes nothing
def later():
    os.environ["TORCH_CPP_LOG_LEVEL"] = "INFO"   # runs after the import, if ever
import torch
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # after the import: torch read the environment already
'''


def test_settings_made_before_torch_is_imported_are_found(tmp_path, monkeypatch):
    from ftrun.launch.import_settings import import_time_settings

    script = tmp_path / "train.py"
    script.write_text(SETS_BEFORE_TORCH)
    found = import_time_settings(str(script), False, {"TMPDIR": "/tmp"})
    assert [(s.name, s.line) for s in found] == [("TORCH_LOGS", 5), ("OMP_NUM_THREADS", 7),
                                                  ("TORCHINDUCTOR_CACHE_DIR", 8), ("MKL_NUM_THREADS", 8)]
    assert found[0].describe() == "train.py:5 sets TORCH_LOGS"
    # a setdefault of a variable the launcher's environment has changes nothing
    assert "OMP_NUM_THREADS" not in [s.name for s in import_time_settings(str(script), False,
                                                                           {"OMP_NUM_THREADS": "4", "TMPDIR": "/tmp"})]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (tmp_path / "pkg" / "__main__.py").write_text(SETS_BEFORE_TORCH)
    monkeypatch.chdir(tmp_path)
    assert len(import_time_settings("pkg", True, {})) == 5  # TMPDIR too: the launcher has none here
    for unreadable in ("pkg.missing", "no_such_module_x"):
        assert import_time_settings(unreadable, True, {}) == []
    (tmp_path / "broken.py").write_text("os.environ['TORCH_LOGS'] = (\n")
    assert import_time_settings(str(tmp_path / "broken.py"), False, {}) == []


@pytest.mark.timeout(120)
def test_a_script_that_sets_omp_num_threads_before_torch_gets_it(start_job, tmp_path):
    script = tmp_path / "threads.py"
    script.write_text("import os\nos.environ['OMP_NUM_THREADS'] = '2'\nimport torch\n"
                      "print('threads', os.environ['RANK'], torch.get_num_threads(), flush=True)\n")
    job = start_job("--nproc-per-node", "2", str(script))
    assert job.wait(90) == 0, job.output
    assert "threads 0 2" in job.output and "threads 1 2" in job.output, job.output
    (notice,) = [e for e in job.events() if e["event"] == "no_zygote"]
    assert notice["variables"] == ["OMP_NUM_THREADS"] and "threads.py:2 sets OMP_NUM_THREADS" in notice["message"]
    assert_job_left_nothing(job)


LEAVES_UPLOADS = '''\
import os, subprocess, sys
out, fail = sys.argv[1], sys.argv[2] == "fail"
if os.environ["RANK"] == "0":  # a last upload, started and not waited for: in its group, in a session of its own
    for tag, own_session in (("group", False), ("session", True)):
        subprocess.Popen(["sh", "-c", f"sleep 6; echo done > {out}/{tag}"], start_new_session=own_session)
elif fail:
    sys.exit(4)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outcome", [pytest.param("succeeds", marks=pytest.mark.extended), "fails"])  # make test: fails
def test_what_trainers_leave_running_outlives_a_job_that_succeeds(start_job, tmp_path, outcome):
    import time

    script, out = tmp_path / "uploads.py", tmp_path / "out"
    script.write_text(LEAVES_UPLOADS)
    out.mkdir()
    job = start_job("--nproc-per-node", "2", "--max-restarts", "0", str(script), str(out),
                    "fail" if outcome == "fails" else "ok")
    assert job.wait(90) == (0 if outcome == "succeeds" else 3), job.output
    deadline = time.monotonic() + (30 if outcome == "succeeds" else 8)  # the uploads take 6 s from their start
    while len(list(out.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    if outcome == "succeeds":  # as under torchrun
        assert sorted(p.name for p in out.iterdir()) == ["group", "session"], job.output
        (left,) = [e for e in job.events() if e["event"] == "left_running"]
        assert len(left["pids"]) == 4  # two sh, two sleep
    else:  # a failed job leaves nothing running
        assert list(out.iterdir()) == [] and not [e for e in job.events() if e["event"] == "left_running"]
    assert_job_left_nothing(job)
