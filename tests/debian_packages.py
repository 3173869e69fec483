"""The Debian packages the tests start real components from (etcd, SLURM, tmux, iproute2): installed with apt
when missing, as on CI's fresh machine. The suite runs in several processes (pytest-xdist): one install at a
time, as apt allows (:data:`LOCK`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess

LOCK = "/tmp/ftrun-tests-apt.lock"  # held around apt-get: a second one at once would fail on dpkg's lock


def apt_install(*packages: str, timeout: float | None = None) -> str | None:
    """Install ``packages`` with apt-get as root, refreshing the package lists only if the install fails without
    them; None when done, else why not (one line)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "apt-get as root is not available to install it"
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _install(packages, timeout)


def _install(packages: tuple[str, ...], timeout: float | None) -> str | None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(command, env=env, capture_output=True, timeout=timeout).returncode == 0:
        return None
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return f"apt-get install {' '.join(packages)} failed: {done.stderr.strip()[-300:]}"
    return None
