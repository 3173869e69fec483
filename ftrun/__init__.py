"""ftrun: fault-tolerant launcher for PyTorch training, and the API its trainers call.

Trainers import this package only for the light calls below; the launcher lives in :mod:`ftrun.launch`.
Outside ftrun (plain ``python`` or ``torchrun``) every call is a no-op, so scripts stay portable.
"""

from __future__ import annotations

import ftrun.startup  # noqa: F401 - first: it records the modules loaded before any of ftrun's
from ftrun.control.heartbeat import heartbeat

__version__ = "0.1.0"
__all__ = ["Snapshotter", "heartbeat", "__version__"]


def __getattr__(name: str) -> object:
    # Snapshotter imports torch; the launcher and the keeper import this package without paying for it.
    if name == "Snapshotter":
        from ftrun.snapshot.client import Snapshotter
        return Snapshotter
    raise AttributeError(f"module 'ftrun' has no attribute {name!r}")
