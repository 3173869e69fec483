"""The modules this interpreter had loaded before any of ftrun's: those of Python's own start (``site``, ``os``,
what ``.pth`` files import) and, for ``python -m``, ``runpy``.

``ftrun/__init__.py`` imports this module first, so :data:`STARTUP_MODULES` holds nothing that ftrun or torch
imported. A trainer forked from the zygote starts with hundreds of modules loaded that ``python script.py`` would
only import after ``sys.path[0]`` is the script's directory; :mod:`ftrun.launch.as_main` forgets those that a
module beside the script shadows, and keeps these, which a fresh interpreter had loaded too.
"""

from __future__ import annotations

import sys

STARTUP_MODULES = frozenset(name for name in sys.modules if name != "ftrun" and not name.startswith("ftrun."))
