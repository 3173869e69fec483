"""Run the user's script (or ``-m`` module) as ``__main__``, as ``python`` runs it, in a process that has already
imported torch and ftrun.

Invariants, each what ``python script.py`` (``python -m module``) gives:

- The code runs in a module that is ``sys.modules["__main__"]`` and stays so after the code returns or fails:
  atexit handlers, threads still running, and pickles of classes defined in the script (``torch.save`` of such
  an object, ``multiprocessing``) find the script's globals. (``runpy.run_path`` puts its caller's module back.)
- Its globals: ``__name__`` ``"__main__"``, ``__file__``, ``__loader__``, ``__spec__`` (None for a script
  file), ``__package__``, ``__cached__`` and ``__builtins__`` the ``builtins`` module.
- ``sys.path[0]`` is the script's directory (a directory or zip file run: itself; ``-m``: the current
  directory), and a module there shadows one of the same name that this process loaded before the user's code
  (:func:`forget_shadowed`): ``import secrets`` beside a ``secrets.py`` imports that file, not the standard
  library's that ftrun imported. Modules of the interpreter's start
  (:data:`~ftrun.startup.STARTUP_MODULES`, which ``python`` loads before the script too) and the packages the
  trainer itself runs on (:data:`KEPT`) are never forgotten.
- ``-m``: the module's parent packages are imported first; a package runs its ``__main__``; what cannot run
  raises :class:`NotRunnable` with ``python -m``'s message.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import importlib.util
import io
import marshal
import os
import sys
import types

from ftrun.startup import STARTUP_MODULES

KEPT = frozenset({"torch", "numpy", "ftrun"})  # loaded before the user's code, and never replaced


class NotRunnable(ImportError):
    """The ``-m`` target cannot run; the message is ``python -m``'s ("No module named x", ...)."""


def forget_shadowed(directory: str) -> list[str]:
    """Forget (drop from ``sys.modules``) every module loaded so far, submodules included, whose top-level
    package a module in ``directory`` shadows; returns the top-level names forgotten. A directory without
    ``__init__.py`` there (a namespace portion) shadows nothing, as for Python's import."""
    try:
        entries = os.listdir(directory)
    except OSError:  # not a directory (a zip file run), or unreadable
        return []
    loaded = {name.partition(".")[0] for name in sys.modules}
    candidates = {entry.partition(".")[0] for entry in entries} & loaded - STARTUP_MODULES - KEPT
    forgotten = []
    for name in sorted(candidates):
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, [directory])
        except (ImportError, OSError, ValueError):
            continue
        if spec is None or spec.loader is None or spec.origin == getattr(sys.modules.get(name), "__file__", None):
            continue
        for key in [key for key in sys.modules if key == name or key.startswith(name + ".")]:
            del sys.modules[key]
        forgotten.append(name)
    if forgotten:
        importlib.invalidate_caches()
    return forgotten


def run_as_main(target: str, module: bool) -> None:
    """Run ``target``, a script path (a file, or a directory or zip file with ``__main__.py``) or with
    ``module`` a module name, as ``__main__`` (module docstring); ``sys.argv[1:]`` are its arguments."""
    main = types.ModuleType("__main__")
    if module:
        sys.path.insert(0, os.getcwd())
        forget_shadowed(sys.path[0])
        spec = _module_spec(target)
        code = spec.loader.get_code(spec.name)  # type: ignore[union-attr]
        if code is None:
            raise NotRunnable(f"No code object available for {spec.name}")
        main.__dict__.update(__file__=spec.origin, __cached__=spec.cached, __loader__=spec.loader,
                             __package__=spec.parent, __spec__=spec)
        sys.argv[0] = spec.origin or target
    elif os.path.isdir(target) or _is_zip(target):
        target = os.path.abspath(target)
        sys.path.insert(0, target)
        forget_shadowed(target)
        spec = importlib.machinery.PathFinder.find_spec("__main__", [target])
        if spec is None or spec.loader is None:
            raise NotRunnable(f"can't find '__main__' module in {target!r}")
        code = spec.loader.get_code("__main__")  # type: ignore[attr-defined]
        main.__dict__.update(__file__=spec.origin, __cached__=None, __loader__=spec.loader, __package__="",
                             __spec__=spec)
    else:
        path = os.path.join(os.getcwd(), target)  # as python's __file__: joined, not normalized (./a.py stays)
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        forget_shadowed(sys.path[0])
        with io.open_code(path) as f:
            data = f.read()
        if data[:4] == importlib.util.MAGIC_NUMBER:  # a compiled file, as python runs one
            code, loader = marshal.loads(data[16:]), importlib.machinery.SourcelessFileLoader("__main__", path)
        else:
            code, loader = compile(data, path, "exec", dont_inherit=True), \
                importlib.machinery.SourceFileLoader("__main__", path)
        main.__dict__.update(__file__=path, __cached__=None, __loader__=loader, __package__=None, __spec__=None)
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _module_spec(name: str) -> importlib.machinery.ModuleSpec:
    """The spec of the module ``python -m name`` runs (a package's ``__main__``); :class:`NotRunnable` with
    python's message when there is none."""
    if name.startswith("."):
        raise NotRunnable("Relative module names not supported")
    parent = name.rpartition(".")[0]
    if parent:
        try:
            importlib.import_module(parent)  # its own errors are the user's, traceback and all
        except ImportError as err:  # a missing ancestor: told as python -m tells it, below
            if err.name is None or (err.name != parent and not parent.startswith(err.name + ".")):
                raise
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise NotRunnable(f"Error while finding module specification for {name!r} "
                          f"({type(err).__name__}: {err})") from err
    if spec is None:
        raise NotRunnable(f"No module named {name}")
    if spec.submodule_search_locations is not None:
        if name == "__main__" or name.endswith(".__main__"):
            raise NotRunnable("Cannot use package as __main__ module")
        try:
            return _module_spec(name + ".__main__")
        except NotRunnable as err:
            raise NotRunnable(f"{err}; {name!r} is a package and cannot be directly executed") from None
    if spec.loader is None:
        raise NotRunnable(f"{name!r} is a namespace package and cannot be executed")
    return spec


def _is_zip(path: str) -> bool:
    import zipfile

    return os.path.isfile(path) and zipfile.is_zipfile(path)
