"""What this interpreter had before any of ftrun's modules loaded: the modules of Python's own start (``site``,
``os``, what ``.pth`` files import) and, for ``python -m``, ``runpy``; and its environment.

``ftrun/__init__.py`` imports this module first, so :data:`STARTUP_MODULES` holds nothing that ftrun or torch
imported. A trainer forked from the zygote starts with hundreds of modules loaded that ``python script.py`` would
only import after ``sys.path[0]`` is the script's directory; :mod:`ftrun.launch.as_main` forgets those that a
module beside the script shadows, and keeps these, which a fresh interpreter had loaded too.

Likewise :data:`STARTUP_ENVIRON` holds no variable that an import wrote: threadpoolctl sets
``KMP_DUPLICATE_LIB_OK=True`` as it loads, torch's inductor ``TORCHINDUCTOR_CACHE_DIR`` when the launcher preloads
``torch._dynamo`` for the zygotes. In ``ftrun``'s first process it is the user's environment; every process of a
job that ftrun starts starts from it plus ftrun's own variables (:func:`ftrun.launch.handoff.exec_launcher`,
:func:`ftrun.launch.handoff.start`), so a trainer gets what the user's shell had, not what the launcher's imports
added (:func:`ftrun.launch.env.trainer_env`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from types import MappingProxyType

STARTUP_MODULES = frozenset(name for name in sys.modules if name != "ftrun" and not name.startswith("ftrun."))
STARTUP_ENVIRON: Mapping[str, str] = MappingProxyType(dict(os.environ))
