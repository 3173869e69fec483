"""The per-job secret: every control-store value is signed with it (:mod:`ftrun.control.signed`), and keepers
authenticate each other with it (:mod:`ftrun.snapshot.transport`).

Local mode: random for each job. Multi-node: every node derives it from a secret file it reads and the job id,
``HMAC-SHA256(file contents, job id)``; the file (``--secret-file``, default ``~/.ftrun/secret``, created with
32 random bytes and mode 0600 when missing: a home directory shared by the nodes does the rest) must not be
readable by other users. The secret reaches supervisors and keepers in their environment (readable by the same
user only), never trainers, and never travels over the network. So that ``ftrun status`` on the job's host can
read the store, each launcher also writes it to ``<shm dir>/ftrun-<job>-secret`` (mode 0600, removed when it
exits, like its ``ftrun-<job>-launcher`` file).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from ftrun.control.spec import safe_job_id, shm_dir, write_shm_file
from ftrun.errors import UsageError

DEFAULT_SECRET_FILE = "~/.ftrun/secret"


def local_secret() -> str:
    return secrets.token_hex(32)


def secret_path(job_id: str) -> str:
    """Where the launchers of ``job_id`` on this host leave its secret for ``ftrun status``."""
    return os.path.join(shm_dir(), f"ftrun-{safe_job_id(job_id)}-secret")


def write_secret_file(job_id: str, secret: str) -> str:
    """Write the job secret to :func:`secret_path` (mode 0600, atomically: launchers of one job may share the
    host); returns the path."""
    path = secret_path(job_id)
    write_shm_file(path, secret)
    return path


def read_secret_file(job_id: str) -> str | None:
    """The secret a launcher of ``job_id`` on this host left (None: none, or not readable)."""
    try:
        with open(secret_path(job_id)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def shared_secret(job_id: str, path: str | None, create: bool = True) -> str:
    """The job secret derived from the secret file at ``path`` (created when missing), as hex."""
    path = os.path.expanduser(path or DEFAULT_SECRET_FILE)
    if not create and not os.path.exists(path):
        raise UsageError(f"no secret file {path} to authenticate with the job's control store (give the job's "
                         "--secret-file)")
    try:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"secret file {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
                             f"run: chmod 600 {path}")
        with open(path, "rb") as f:
            key = f.read()
    except FileExistsError:  # another node created it meanwhile
        return shared_secret(job_id, path)
    except OSError as err:
        raise UsageError(f"cannot read the secret file {path}: {err.strerror}") from None
    if len(key) < 16:
        raise UsageError(f"secret file {path} holds {len(key)} bytes; it needs at least 16")
    return hmac.new(key, job_id.encode(), hashlib.sha256).hexdigest()
