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
