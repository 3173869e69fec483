"""The per-job secret that keepers authenticate each other with (:mod:`ftrun.snapshot.transport`).

Local mode: random for each job. Multi-node: every node derives it from a secret file it reads and the job id,
``HMAC-SHA256(file contents, job id)``; the file (``--secret-file``, default ``~/.ftrun/secret``, created with
32 random bytes and mode 0600 when missing: a home directory shared by the nodes does the rest) must not be
readable by other users. The secret reaches supervisors and keepers in their environment (readable by the same
user only), never trainers, and never travels over the network.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from ftrun.errors import UsageError

DEFAULT_SECRET_FILE = "~/.ftrun/secret"


def local_secret() -> str:
    return secrets.token_hex(32)


def shared_secret(job_id: str, path: str | None) -> str:
    """The job secret derived from the secret file at ``path`` (created when missing), as hex."""
    path = os.path.expanduser(path or DEFAULT_SECRET_FILE)
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
