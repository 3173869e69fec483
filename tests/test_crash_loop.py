"""Crash loops and clean tracebacks (issue 16).

A trainer's uncaught exception is printed as ``python script.py`` prints it (the user's frames only, none of
ftrun's zygote, bootstrap or runpy), zygote-forked or not, script or ``-m`` module, and recorded in its
torchelastic error file. A failure before the first heartbeat that repeats, the same way, the one that started
the generation ends the job (exit 3) with one clear line instead of restarting it up to --max-restarts times;
every other failure restarts as before.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import assert_job_left_nothing
from ftrun.control.coordination import Failure, Generation
from ftrun.launch import bootstrap
from ftrun.launch.bootstrap import (ENV_EARLY_FAILURE, _same_as_earlier, clean_traceback, signature, user_traceback,
                                    write_error_file)
from ftrun.launch.supervisor import CRASH_LOOP, Supervisor, _early_failure_env

TRACEBACK = "Traceback (most recent call last)"
RUNPY_LINE = '  File "<frozen runpy>"'

CHAINED = '''\
import sys


def inner():
    raise ValueError("bad value")


def outer():
    try:
        inner()
    except ValueError as err:
        raise RuntimeError("wrapped " + sys.argv[1]) from err


outer()
'''
SYNTAX = "x = (\n"
MISSING_IMPORT = "import os\nimport no_such_module_ftrun_test\n"
SAME_AT_IMPORT = 'raise ValueError("device_ids can only be used with a CUDA module")\n'
# another word each time (another number alone would be the same failure: a crash loop)
DIFFERENT_AT_IMPORT = ('import os\nraise ValueError("broken in restart " + "abcdef"[int(os.environ['
                       '"TORCHELASTIC_RESTART_COUNT"])])\n')
AFTER_FIRST_BEAT = ('import os, ftrun\nftrun.heartbeat(int(os.environ["TORCHELASTIC_RESTART_COUNT"]))\n'
                    'raise ValueError("broken after the first heartbeat")\n')  # at another step each time
ABORT_AT_IMPORT = "import os\nos.abort()\n"


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def python_stderr(*args: str, cwd: Path) -> tuple[int, str]:
    """What plain ``python ARGS`` prints on stderr, and its exit code."""
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr


def bootstrap_run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``ftrun.launch.bootstrap`` as a --no-zygote trainer runs it."""
    return subprocess.run([sys.executable, "-u", "-P", "-m", "ftrun.launch.bootstrap", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def primary_failures(job) -> list[dict]:
    return [e for e in job.events() if e["event"] == "failure" and e.get("primary", True)]


def generations_started(job) -> list[int]:
    return sorted(e["generation"] for e in job.events() if e["event"] == "trainers_started")


EVENT_LINE = re.compile(r"ftrun \d\d:\d\d:\d\d\.\d{3} \[[^\]\n]*\] [^\n]*\n")


def trainer_output(job) -> str:
    """The job's output without ftrun's own lines. They may come between a trainer's lines, or inside one: a
    trainer writing straight to the console may write a line in pieces (Python prints a SyntaxError's caret line
    so), and a supervisor's event line can land between them, as under torchrun."""
    text = EVENT_LINE.sub("", job.output)
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("ftrun"))


def assert_no_launcher_frames(text: str) -> None:
    assert "ftrun/launch/zygote.py" not in text and "ftrun/launch/bootstrap.py" not in text, text
    assert "runpy" not in text, text


# -- the traceback filter, the signature and the error file (unit) -------------------------------------------------
def _chain(*filenames: str):
    """A function that calls through one function compiled under each of ``filenames``; the last raises."""
    namespace: dict = {}
    callee = "raise KeyError('deep')"
    for depth, filename in reversed(list(enumerate(filenames))):
        exec(compile(f"def f{depth}():\n    {callee}\n", filename, "exec"), namespace)
        callee = f"f{depth}()"
    return namespace["f0"]


def test_user_traceback_drops_only_the_leading_frames_of_ftrun_and_runpy():
    launcher = os.path.join(os.path.dirname(bootstrap.__file__), "zygote.py")
    chain = _chain(launcher, "<frozen runpy>", bootstrap.__file__, "/home/user/train.py", "<frozen runpy>",
                   "/home/user/model.py")
    with pytest.raises(KeyError) as info:
        chain()
    tb = user_traceback(info.value.__traceback__.tb_next)  # from the chain's first frame on (not this test's)
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert files == ["/home/user/train.py", "<frozen runpy>", "/home/user/model.py"]  # runpy the user called stays


def test_user_traceback_of_launcher_frames_only_is_none():
    chain = _chain(bootstrap.__file__, "<frozen runpy>")
    with pytest.raises(KeyError) as info:
        chain()
    assert user_traceback(info.value.__traceback__.tb_next) is None


def test_signature_is_torchelastics_type_and_message():
    assert signature(ValueError("bad value")) == "ValueError: bad value"
    assert signature(RuntimeError()) == "RuntimeError: "

    class Unprintable(Exception):
        def __str__(self):
            raise TypeError("no")

    assert signature(Unprintable()) == "Unprintable: <exception str() failed>"


def test_error_file_has_torchelastics_format_and_never_overwrites(tmp_path):
    try:
        raise ValueError("bad value")
    except ValueError as err:
        exc = err
    path = tmp_path / "error.json"
    write_error_file(exc, str(path))
    doc = json.loads(path.read_text())
    assert doc["message"]["message"] == "ValueError: bad value"
    assert doc["message"]["extraInfo"]["py_callstack"] == clean_traceback(exc)
    assert doc["message"]["extraInfo"]["py_callstack"].endswith("ValueError: bad value\n")
    assert int(doc["message"]["extraInfo"]["timestamp"]) > 0
    write_error_file(RuntimeError("later"), str(path))  # written first by the script's @record: kept
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: bad value"
    write_error_file(exc, None)  # no error file: nothing to do


def test_same_as_earlier_compares_signatures():
    earlier = json.dumps({"generation": 3, "signature": "ValueError: bad"})
    assert _same_as_earlier("ValueError: bad", earlier) == 3
    assert _same_as_earlier("ValueError: other", earlier) is None
    assert _same_as_earlier("ValueError: bad", None) is None
    assert _same_as_earlier("ValueError: bad", "not json") is None


# -- the crash-loop rule (unit) ------------------------------------------------------------------------------------
def crash(signature: str = "ValueError: bad", early: bool = True, step: int | None = None) -> Failure:
    return Failure("crash", "rank 0 exited with code 1 (ValueError: bad)", 0, 0, "waitpid", step,
                   signature=signature, early=early)


def hang(rank: int, step: int | None) -> Failure:
    return Failure("hang", f"rank {rank} hung: no heartbeat for 31.0s", 0, rank, "heartbeat", step)


def started_by(signature: str = "ValueError: bad", early: bool = True, kind: str = "crash", gen: int = 1,
               step: int | None = None):
    return Generation(gen, kind, "rank 1 exited with code 1", 0, 1, "waitpid", 1.0, step, None, signature, early)


@pytest.mark.parametrize("cause, failure, loop", [
    (started_by(), crash(), True),
    (started_by(signature="killed by SIGABRT"), crash(signature="killed by SIGABRT"), True),
    (started_by(), crash(signature="ValueError: other"), False),  # not the same way
    # the same way, but another peer port (gloo), pid, address or value in the message: each run differs there
    (started_by(early=False, step=5, signature="RuntimeError: Connection closed by peer [127.0.0.1]:690"),
     crash(early=False, step=5, signature="RuntimeError: Connection closed by peer [127.0.0.1]:48262"), True),
    (started_by(signature="RuntimeError: loss is nan at 0x7f3a12"), crash(signature="RuntimeError: loss is nan at "
                                                                          "0x7f9b40"), True),
    (started_by(signature="ValueError: bad 1"), crash(signature="ValueError: bad 1 2"), False),
    (started_by(early=False), crash(), False),  # the first failure came after a heartbeat
    (started_by(), crash(early=False), False),  # this one comes after a heartbeat
    (started_by(kind="hang"), crash(), False),
    (started_by(kind="node-lost", signature="", early=False), crash(), False),
    (Generation(0, "start", "job started"), crash(), False),  # generation 0: nothing to repeat
    (started_by(signature=""), crash(signature=""), False),  # no signature: nothing to compare
    (started_by(early=False, step=16), crash(early=False, step=16), True),  # the same step after the restore
    (started_by(early=False, step=16), crash(early=False, step=17), False),  # later: the restore got further
    (started_by(early=False, step=16), crash(early=False, signature="ValueError: other", step=16), False),
    (started_by(early=False, kind="hang", step=16), crash(early=False, step=16), False),
    # a hang of the same rank at the same step: a deadlock there, or a step slower than the hang timeout
    (started_by(early=False, kind="hang", step=16), hang(rank=1, step=16), True),
    (started_by(early=False, kind="hang", step=16), hang(rank=0, step=16), False),  # another rank
    (started_by(early=False, kind="hang", step=16), hang(rank=1, step=17), False),  # the restore got further
    (started_by(early=False, kind="hang"), hang(rank=1, step=None), False),  # before a heartbeat: no step
    (started_by(early=False, step=16), hang(rank=1, step=16), False),  # a crash, then a hang
])
def test_crash_loop_rule(cause, failure, loop):
    assert cause.repeated_by(failure) is loop


def test_crash_loop_becomes_a_fatal_failure_with_one_clear_reason_unless_the_limit_ends_the_job():
    def reported(cause: Generation, failure: Failure, max_restarts: int = 10) -> Failure:
        supervisor = SimpleNamespace(spec=SimpleNamespace(max_restarts=max_restarts))
        return Supervisor._crash_loop(supervisor, cause.encode().encode(), failure)  # type: ignore[arg-type]

    fatal = reported(started_by(), crash())
    assert fatal.kind == "fatal" and (fatal.node, fatal.rank) == (0, 0)
    assert fatal.reason == f"{CRASH_LOOP}: ValueError: bad" == \
        "failed the same way twice before its first step; not restarting: ValueError: bad"
    assert reported(started_by(), crash(early=False)) == crash(early=False)  # restarts as before
    again = reported(started_by(early=False, step=16), crash(early=False, step=16))
    assert again.kind == "fatal" and again.reason == "failed the same way twice at step 16; not restarting: " \
        "ValueError: bad"
    hung = reported(started_by(early=False, kind="hang", step=16), hang(rank=1, step=16))
    assert hung.kind == "fatal" and hung.reason == "hung twice at step 16; not restarting (a step that " \
        "legitimately takes this long needs a larger --hang-timeout): rank 1 hung: no heartbeat for 31.0s"
    assert reported(started_by(gen=1), crash(), max_restarts=1) == crash()  # the restart limit ends it anyway
    assert reported(started_by(gen=1), crash(), max_restarts=2).kind == "fatal"


def test_generation_documents_carry_the_signature_and_old_ones_still_decode():
    gen = started_by()
    assert Generation.decode(gen.encode()) == gen
    old = {"gen": 2, "kind": "crash", "reason": "r", "node": 0, "rank": 1, "detected_by": "waitpid", "time": 1.0,
           "step": None, "incarnation": None}
    assert Generation.decode(json.dumps(old)) == Generation(2, "crash", "r", 0, 1, "waitpid", 1.0)
    assert Generation.decode(json.dumps({**old, "from_a_newer_ftrun": 1})).gen == 2
    with pytest.raises(TypeError):
        Generation.decode("[1, 2]")


def test_trainers_after_an_early_crash_are_told_its_signature():
    assert json.loads(_early_failure_env(started_by(gen=2))[ENV_EARLY_FAILURE]) == \
        {"generation": 1, "signature": "ValueError: bad"}
    assert _early_failure_env(started_by(early=False)) == {}
    assert _early_failure_env(Generation(0, "start", "job started")) == {}


# -- the bootstrap prints as python does (a --no-zygote trainer's program) -----------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", [CHAINED, SYNTAX, MISSING_IMPORT, "import sys\nsys.exit(4)\n",
                                    "import sys\nsys.exit('bye')\n", "raise KeyboardInterrupt\n",
                                    "print('fine')\n"],
                         ids=["chained", "syntax", "import", "exit-code", "exit-message", "keyboard-interrupt", "ok"])
def test_bootstrap_prints_and_exits_as_python_does(tmp_path, source):
    script = write(tmp_path, "script.py", source)
    code, expected = python_stderr(str(script), "arg", cwd=tmp_path)
    done = bootstrap_run(str(script), "arg", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (code, expected)


@pytest.mark.timeout(60)
def test_bootstrap_module_mode_prints_as_python_minus_runpy(tmp_path):
    write(tmp_path, "chained_mod.py", CHAINED)
    code, expected = python_stderr("-m", "chained_mod", "arg", cwd=tmp_path)
    assert RUNPY_LINE in expected  # python -m shows runpy's frames; a trainer does not
    done = bootstrap_run("-m", "chained_mod", "arg", cwd=tmp_path)
    assert done.returncode == code == 1
    assert done.stderr == "".join(line for line in expected.splitlines(keepends=True)
                                  if not line.startswith(RUNPY_LINE))
    code, expected = python_stderr("-m", "no_such_module_ftrun_test", cwd=tmp_path)
    done = bootstrap_run("-m", "no_such_module_ftrun_test", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (code, expected)


@pytest.mark.timeout(60)
def test_bootstrap_sees_what_python_script_sees(tmp_path):
    (tmp_path / "sub").mkdir()
    script = write(tmp_path / "sub", "show.py", "import sys\nprint(sys.argv, sys.path[0], __name__, __file__)\n")
    (tmp_path / "link.py").symlink_to(script)
    for target in (script, tmp_path / "link.py", "sub/show.py", "./link.py"):  # relative: sys.argv[0] as given
        expected = subprocess.run([sys.executable, str(target), "a"], cwd=tmp_path, capture_output=True, text=True)
        assert bootstrap_run(str(target), "a", cwd=tmp_path).stdout == expected.stdout
    write(tmp_path, "showmod.py", "import sys\nprint(sys.argv, sys.path[0], __name__, __file__)\n")
    expected = subprocess.run([sys.executable, "-m", "showmod", "a"], cwd=tmp_path, capture_output=True, text=True)
    assert bootstrap_run("-m", "showmod", "a", cwd=tmp_path).stdout == expected.stdout


@pytest.mark.timeout(60)
class CountedWrites(io.StringIO):
    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_a_traceback_is_printed_in_one_write(monkeypatch):
    """Ranks failing at the same moment (all of them, at import) print at once: Python's hook writes a traceback
    piece by piece (13 writes for this one; with PYTHONUNBUFFERED each a write to the shared console), so their
    lines came out interleaved a few characters at a time. The text is Python's own."""
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # as in a trainer: an earlier test may have set one
    try:
        raise ValueError("device_ids can only be used with a CUDA module")
    except ValueError as err:
        exc = err
    for printer in (sys.__excepthook__, lambda *info: bootstrap._print_exception(info[1], info[2])):
        counted = CountedWrites()
        monkeypatch.setattr(sys, "stderr", counted)
        printer(type(exc), exc, exc.__traceback__)
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        if printer is sys.__excepthook__:
            python = counted.getvalue()
            assert counted.writes > 5
        else:
            assert counted.getvalue() == python and counted.writes == 1


def test_bootstrap_writes_the_error_file_and_prints_a_repeat_in_one_line(tmp_path):
    script = write(tmp_path, "same.py", SAME_AT_IMPORT)
    error_file = tmp_path / "error.json"
    error_file.write_text("left by an earlier run")
    done = bootstrap_run(str(script), cwd=tmp_path, env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == 1 and done.stderr.count(TRACEBACK) == 1
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: device_ids can only be used with a CUDA module"
    assert TRACEBACK in message["extraInfo"]["py_callstack"]
    assert_no_launcher_frames(message["extraInfo"]["py_callstack"])
    earlier = json.dumps({"generation": 0, "signature": message["message"]})
    done = bootstrap_run(str(script), cwd=tmp_path, env={ENV_EARLY_FAILURE: earlier, "RANK": "3",
                                                         "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == 1
    assert done.stderr == ("rank 3: same failure as generation 0: ValueError: device_ids can only be used with a "
                           "CUDA module (traceback above)\n")
    assert json.loads(error_file.read_text())["message"]["message"] == message["message"]
    other = json.dumps({"generation": 0, "signature": "ValueError: something else"})
    done = bootstrap_run(str(script), cwd=tmp_path, env={ENV_EARLY_FAILURE: other})
    assert done.stderr.count(TRACEBACK) == 1
    shown = bootstrap_run(str(write(tmp_path, "env.py", f"import os\nprint({ENV_EARLY_FAILURE!r} in os.environ)\n")),
                          cwd=tmp_path, env={ENV_EARLY_FAILURE: other})
    assert shown.stdout == "False\n"  # ftrun's, not the script's


# -- real jobs ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["zygote", "no-zygote"])
def test_trainer_traceback_in_a_job_is_pythons(start_job, tmp_path, mode):
    script = write(tmp_path, "chained.py", CHAINED)
    _, expected = python_stderr(str(script), "arg", cwd=tmp_path)
    job = start_job("--max-restarts", "0", f"--{mode}", str(script), "arg")
    assert job.wait() == 3, job.output
    assert trainer_output(job).count(expected) == 1
    assert job.output.count(TRACEBACK) == 2  # the exception and its cause: once
    assert_no_launcher_frames(job.output)
    [failure] = primary_failures(job)
    assert failure["signature"] == "RuntimeError: wrapped arg" and failure["early"] is True
    assert "rank 0 exited with code 1 (RuntimeError: wrapped arg)" in failure["message"]
    error = json.loads((job.log_dir / "gen0" / "rank0" / "error.json").read_text())
    assert error["message"]["extraInfo"]["py_callstack"] == expected
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["zygote", "no-zygote"])
def test_module_trainer_traceback_in_a_job_has_no_runpy_frames(start_job, tmp_path, mode):
    write(tmp_path, "chained_mod.py", CHAINED)
    _, expected = python_stderr("-m", "chained_mod", "arg", cwd=tmp_path)
    expected = "".join(line for line in expected.splitlines(keepends=True) if not line.startswith(RUNPY_LINE))
    job = start_job("--max-restarts", "0", f"--{mode}", "-m", "chained_mod", "arg")  # cwd: tmp_path
    assert job.wait() == 3, job.output
    assert expected in trainer_output(job)
    assert_no_launcher_frames(job.output)
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source, last_line", [
    (MISSING_IMPORT, "ModuleNotFoundError: No module named 'no_such_module_ftrun_test'"),
    (SYNTAX, "SyntaxError: '(' was never closed"),
], ids=["import", "syntax"])
def test_import_and_syntax_errors_in_a_job_look_as_under_python(start_job, tmp_path, source, last_line):
    script = write(tmp_path, "broken.py", source)
    _, expected = python_stderr(str(script), cwd=tmp_path)
    assert expected.endswith(last_line + "\n")
    job = start_job("--max-restarts", "0", str(script))
    assert job.wait() == 3, job.output
    assert expected in trainer_output(job)
    assert_no_launcher_frames(job.output)
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
def test_same_failure_at_import_twice_stops_the_job_with_one_line(start_job, tmp_path):
    """Default --max-restarts (10): generation 0 fails, generation 1 fails the same way, the job ends (exit 3).
    Each rank prints its traceback once (generation 0); in generation 1 a rank that fails the same way prints
    one line instead."""
    script = write(tmp_path, "same.py", SAME_AT_IMPORT)
    job = start_job("--nproc-per-node", "2", str(script))
    assert job.wait() == 3, job.output
    output = job.output
    assert generations_started(job) == [0, 1]
    reason = f"{CRASH_LOOP}: ValueError: device_ids can only be used with a CUDA module"
    assert [(f["kind"], f["generation"]) for f in primary_failures(job)] == [("crash", 1), ("fatal", 2)]
    assert primary_failures(job)[1]["message"].startswith(f"failure: {reason}")
    assert f"job failed: {reason}" in output
    assert "restarting every node's trainers" in output and output.count("restarting every node's trainers") == 1
    # gen 0: each rank printed its traceback at most once (the first failure stops the others, maybe while they
    # print; two ranks' lines may interleave); the rank whose failure was reported printed all of it
    final = "ValueError: device_ids can only be used with a CUDA module"
    assert 1 <= output.splitlines().count(final) <= output.count(TRACEBACK) <= 2, output
    # gen 1: no traceback again, at most one line per rank
    repeats = [line for line in output.splitlines() if "same failure as generation 0" in line]
    assert 1 <= len(repeats) <= 2, output
    assert {line.split(":")[0] for line in repeats} <= {"rank 0", "rank 1"} and len(set(repeats)) == len(repeats)
    assert all(line.endswith("ValueError: device_ids can only be used with a CUDA module (traceback above)")
               for line in repeats)
    assert_no_launcher_frames(output)
    assert "1 restart(s)" in output and "limit reached" not in output
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: test_recovery's test_restart_limit_ends_job_with_summary_and_no_orphans
@pytest.mark.timeout(180)
def test_a_different_failure_each_generation_restarts_up_to_the_limit(start_job, tmp_path):
    script = write(tmp_path, "different.py", DIFFERENT_AT_IMPORT)
    job = start_job("--max-restarts", "2", str(script))
    assert job.wait() == 3, job.output
    assert generations_started(job) == [0, 1, 2]
    assert [f["kind"] for f in primary_failures(job)] == ["crash"] * 3
    assert "restart limit reached (2 restarts)" in job.output and CRASH_LOOP not in job.output
    assert job.output.count(TRACEBACK) == 3  # each one is new: printed in full
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
def test_the_same_failure_after_the_first_heartbeat_restarts_as_before(start_job, tmp_path):
    script = write(tmp_path, "after.py", AFTER_FIRST_BEAT)
    job = start_job("--max-restarts", "2", str(script))
    assert job.wait() == 3, job.output
    assert generations_started(job) == [0, 1, 2]
    failures = primary_failures(job)
    assert [(f["kind"], f["early"]) for f in failures] == [("crash", False)] * 3
    assert {f["signature"] for f in failures} == {"ValueError: broken after the first heartbeat"}
    assert "restart limit reached (2 restarts)" in job.output and CRASH_LOOP not in job.output
    assert "same failure as generation" not in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
def test_the_same_failure_at_the_same_step_twice_stops_the_job(start_job, tmp_path):
    """A restore replays the steps bit for bit: a crash at the step it restores (or after the last snapshot)
    comes back at every restart; it restarted up to --max-restarts."""
    script = write(tmp_path, "same_step.py", 'import ftrun\nftrun.heartbeat(3)\nraise ValueError("broken at 3")\n')
    job = start_job(str(script))
    assert job.wait() == 3, job.output
    assert generations_started(job) == [0, 1]
    assert "job failed: failed the same way twice at step 3; not restarting: ValueError: broken at 3" in job.output
    assert_job_left_nothing(job)


HANGS_AT_12 = """\
import os, time, ftrun
for step in range(1000):
    ftrun.heartbeat(step)
    if step == 12 and os.environ["RANK"] == "1":
        time.sleep(3600)  # a deadlock at step 12; rank 0 goes on beating
    time.sleep(0.1)
"""


@pytest.mark.timeout(120)
def test_a_hang_of_the_same_rank_at_the_same_step_twice_stops_the_job(start_job, tmp_path):
    """A deadlock at step N (or a step slower than the hang timeout) comes back after every restore: it hung
    and restarted up to --max-restarts, each time after the hang timeout."""
    job = start_job("--nproc-per-node", "2", "--hang-timeout", "1", str(write(tmp_path, "hangs.py", HANGS_AT_12)))
    assert job.wait(100) == 3, job.output
    assert generations_started(job) == [0, 1]
    assert "job failed: hung twice at step 12; not restarting (a step that legitimately takes this long needs a " \
        "larger --hang-timeout): rank 1 hung" in job.output
    assert_job_left_nothing(job)


LEAVES_EARLY = """\
import sys, time, torch, torch.distributed as dist, ftrun
dist.init_process_group("gloo")
total = torch.zeros(4)
for step in range(20):
    ftrun.heartbeat(step)
    if dist.get_rank() == 1 and step == 5:
        sys.exit(0)  # its data ran out
    dist.all_reduce(total)
    time.sleep(0.02)
"""


@pytest.mark.timeout(120)
def test_a_rank_that_left_early_is_named_and_its_loop_stops_the_job(start_job, tmp_path):
    """A rank whose data ran out exits 0 while the others wait in a collective: they failed with gloo's
    "Connection closed by peer [127.0.0.1]:PORT", which named no rank, with another port at every restart, so
    it was never a crash loop: all 10 restarts were spent."""
    script = write(tmp_path, "leaves.py", LEAVES_EARLY)
    job = start_job("--nproc-per-node", "2", str(script))
    assert job.wait() == 3, job.output
    assert "rank 0 exited with code 1 after rank 1 had exited 0 at step 5 (RuntimeError: " in job.output, job.output
    assert generations_started(job) == [0, 1] and "failed the same way twice at step 5" in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_an_exit_with_a_message_is_reported_with_it(start_job, tmp_path):
    """``sys.exit("message")``: Python prints the message and exits 1; the failure line said only "exited with
    code 1"."""
    script = write(tmp_path, "exits.py", 'import sys, ftrun\nftrun.heartbeat(3)\nsys.exit("fatal: config broken")\n')
    job = start_job("--max-restarts", "0", str(script))
    assert job.wait() == 3, job.output
    assert "rank 0 exited with code 1 (SystemExit: fatal: config broken)" in job.output, job.output


@pytest.mark.timeout(120)
def test_a_failed_job_leaves_its_cause_in_the_error_file_ftrun_was_given(start_job, tmp_path):
    """As torchrun copies its root-cause child's error file to its own TORCHELASTIC_ERROR_FILE (TorchX reads it):
    the file of the rank whose failure ended the job."""
    script = write(tmp_path, "fails.py", 'import os, ftrun\nftrun.heartbeat(3)\n'
                   'if os.environ["RANK"] == "1":\n    raise ValueError("boom from rank 1")\n')
    job = start_job("--nproc-per-node", "2", "--max-restarts", "0", str(script),
                    env={"TORCHELASTIC_ERROR_FILE": str(tmp_path / "launcher-error.json")})
    assert job.wait() == 3, job.output
    record = json.loads((tmp_path / "launcher-error.json").read_text())
    assert record["message"]["message"] == "ValueError: boom from rank 1"
    assert 'raise ValueError("boom from rank 1")' in record["message"]["extraInfo"]["py_callstack"]
    assert record["message"]["errorCode"] == 1  # the trainer's exit code, as torchrun's agent adds it


def memory_cgroup(limit: int) -> tuple[Path, str] | None:
    """A new memory cgroup limited to ``limit`` bytes, as (directory, the file a process joins it by); None
    where none can be made here (not root, no writable memory controller)."""
    name = f"ftrun-test-{os.getpid()}"
    for parent, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                               (Path("/sys/fs/cgroup"), "memory.max")):
        try:
            (parent / name).mkdir()
        except OSError:
            continue
        try:
            (parent / name / limit_file).write_text(str(limit))
            return parent / name, "cgroup.procs"
        except OSError:
            (parent / name).rmdir()
    return None


OUT_OF_MEMORY = """\
import os, sys, ftrun
ftrun.heartbeat(1)
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
hog = [bytearray(16 << 20) for _ in range(64)]  # 1 GiB against 256 MiB: the OOM killer's SIGKILL
"""


@pytest.mark.timeout(120)
def test_a_trainer_the_oom_killer_killed_is_reported_as_out_of_memory(start_job, tmp_path):
    """A SIGKILL says nothing of who sent it: 'killed by SIGKILL' was all a user learned of running out of
    memory."""
    cgroup = memory_cgroup(256 << 20)
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (needs root and a writable memory controller)")
    try:
        script = write(tmp_path, "hog.py", OUT_OF_MEMORY)
        job = start_job("--max-restarts", "0", str(script), str(cgroup[0]))
        assert job.wait() == 3, job.output
        assert ("rank 0 killed by SIGKILL (out of memory? the kernel's OOM killer ran since the trainers started)"
                in job.output), job.output
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                cgroup[0].rmdir()
                break
            except OSError:  # its process not reaped yet
                time.sleep(0.1)


@pytest.mark.timeout(180)
def test_the_same_signal_at_import_twice_stops_the_job(start_job, tmp_path):
    script = write(tmp_path, "abort.py", ABORT_AT_IMPORT)
    job = start_job(str(script))
    assert job.wait() == 3, job.output
    assert generations_started(job) == [0, 1]
    assert [(f["kind"], f["signature"]) for f in primary_failures(job)] == \
        [("crash", "killed by SIGABRT"), ("fatal", "killed by SIGABRT")]
    assert f"job failed: {CRASH_LOOP}: killed by SIGABRT" in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
def test_a_script_that_never_beats_and_fails_the_same_way_after_running_a_while_restarts_as_under_torchrun(
        start_job, tmp_path):
    """An unmodified torchrun script cannot tell its steps: once its trainers ran for --hang-timeout-initial
    seconds (the time a trainer is given to start), a repeated failure is not one at its start."""
    script = write(tmp_path, "late.py", 'import time\ntime.sleep(2)\nraise ValueError("the same late failure")\n')
    job = start_job("--max-restarts", "2", "--hang-timeout-initial", "1", str(script))
    assert job.wait() == 3, job.output
    assert generations_started(job) == [0, 1, 2]
    assert [(f["kind"], f["early"]) for f in primary_failures(job)] == [("crash", False)] * 3
    assert "restart limit reached (2 restarts)" in job.output and CRASH_LOOP not in job.output
    assert_job_left_nothing(job)
