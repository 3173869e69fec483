"""Trainers forked by the zygote start with what training scripts import next, and with the zygote's objects out
of reach of their garbage collector."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)

TRAINER = """\
import gc, json, sys
first = {"preloaded": [name for name in %r if name in sys.modules], "frozen": gc.get_freeze_count()}
import torch._dynamo  # what a script does next costs nothing now
json.dump(first, open(sys.argv[1], "w"))
"""


def test_a_trainer_starts_with_the_preload_imported_and_the_zygotes_objects_frozen(tmp_path):
    from ftrun.launch.zygote import PRELOAD

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER % (PRELOAD,))
    report = tmp_path / "report.json"
    # a process that has imported torch only, as a supervisor started as a new interpreter: its zygote preloads
    driver = textwrap.dedent(f"""
        import os, sys
        import torch
        assert "torch._dynamo" not in sys.modules
        from ftrun.launch.processes import become_subreaper
        from ftrun.launch.zygote import SpawnRequest, ZygoteClient
        become_subreaper()
        zygote = ZygoteClient()
        try:
            pid = zygote.spawn(SpawnRequest(target={str(script)!r}, args=[{str(report)!r}], module=False,
                                            env=dict(os.environ), cwd=os.getcwd()))
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        finally:
            zygote.close()
        os.waitpid(zygote.pid, 0)
        assert "torch._dynamo" not in sys.modules  # the zygote imported it, not its parent
        """)
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    first = json.loads(report.read_text())
    assert first["preloaded"] == list(PRELOAD)
    assert first["frozen"] > 100_000  # torch and dynamo's objects (about 280,000)


def test_preload_in_a_process_freezes_what_it_imported():
    code = ("import gc, sys\nfrom ftrun.launch.zygote import PRELOAD, preload\npreload()\n"
            "print(all(name in sys.modules for name in PRELOAD), gc.get_freeze_count() > 100_000)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


READY_TRAINER = """\
import json, os, sys
links = []
for fd in os.listdir("/proc/self/fd"):
    try:
        links.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # the listing's own
        pass
print(json.dumps({"mark": os.environ.get("MARK"), "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
                  "sockets": [link for link in links if link.startswith("socket:")]}))
"""


def test_the_zygote_forks_trainers_ahead_and_a_request_runs_in_one_of_them(tmp_path):
    """The zygote keeps ``ready`` trainers forked, re-parented and waiting: a request runs in one of them, with
    its own environment, directory and stdout, and nothing of the zygote's sockets; one that died before its
    request is skipped (the trainer is forked when asked); they are forked again after a quiet spell, and end
    with the zygote."""
    script = tmp_path / "trainer.py"
    script.write_text(READY_TRAINER)
    driver = textwrap.dedent(f"""
        import json, os, signal, sys, time
        import psutil
        import torch
        from ftrun.launch.processes import READY_NAME, become_subreaper
        from ftrun.launch.zygote import REFILL_QUIET, SpawnRequest, ZygoteClient

        def ready():
            return sorted(p.pid for p in psutil.Process().children() if p.name() == READY_NAME)

        def wait_ready(count):
            deadline = time.monotonic() + 30
            while len(ready()) != count:
                assert time.monotonic() < deadline, ready()
                time.sleep(0.01)
            return ready()

        become_subreaper()
        zygote = ZygoteClient(ready=2)
        first = wait_ready(2)
        os.kill(first[1], signal.SIGKILL)
        os.waitpid(first[1], 0)
        reports = []
        for mark in ("a", "b"):
            out = open({str(tmp_path)!r} + f"/{{mark}}.out", "w")
            pid = zygote.spawn(SpawnRequest({str(script)!r}, [], False, dict(os.environ, MARK=mark),
                                            {str(tmp_path)!r}, stdio=[1]), fds=[out.fileno()])
            out.close()
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
            reports.append(json.load(open({str(tmp_path)!r} + f"/{{mark}}.out")))
        assert reports[0]["pid"] == first[0] and reports[1]["pid"] not in first, (first, reports)
        time.sleep(REFILL_QUIET)
        again = wait_ready(2)
        zygote.close()
        for pid in again:
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        print(json.dumps({{"driver": os.getpid(), "reports": reports}}))
        """)
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for mark, report in zip("ab", found["reports"]):
        assert report["mark"] == mark and report["cwd"] == str(tmp_path)
        assert report["sockets"] == [], report  # neither the zygote's nor another ready trainer's
        assert report["ppid"] == found["driver"]  # the supervisor's child, as any trainer


def test_a_trainer_that_cannot_become_the_supervisors_child_is_an_error_not_a_lost_trainer(tmp_path):
    """Without the child-subreaper mark a forked trainer is re-parented elsewhere, where its supervisor would never
    see it exit: the zygote answers an error (the supervisor then starts trainers as new processes)."""
    driver = textwrap.dedent("""
        import os
        from ftrun.launch.zygote import SpawnRequest, ZygoteClient
        zygote = ZygoteClient(ready=0)
        try:
            zygote.spawn(SpawnRequest("unused.py", [], False, dict(os.environ), os.getcwd()))
        except RuntimeError as err:
            print(err)
        finally:
            zygote.close()
        """)
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "not re-parented to the supervisor" in done.stdout, done.stdout


def test_a_zygote_ended_while_it_forks_ready_trainers_leaves_no_process_running_its_code(tmp_path):
    """A supervisor ends its zygote (the job ended) while the zygote is forking ready trainers: each one half made
    exits quietly; none runs the zygote's loop (it printed 'ValueError: peek of closed file')."""
    driver = textwrap.dedent("""
        import os, time
        from ftrun.launch.processes import become_subreaper, reap
        from ftrun.launch.zygote import ZygoteClient, preload
        become_subreaper()
        preload()  # as the launcher does: each zygote starts forking at once
        for attempt in range(12):
            zygote = ZygoteClient(ready=8)
            time.sleep(0.008 * attempt)
            zygote.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reap()
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            time.sleep(0.02)
        print("done")
        """)
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    assert "Traceback" not in done.stderr, done.stderr
