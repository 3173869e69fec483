"""Settings a script makes before it imports torch that only take effect if torch is imported after them.

A trainer forked from the zygote starts with torch (and numpy, and torch._dynamo) imported. A script that sets,
at its top::

    os.environ["OMP_NUM_THREADS"] = "2"   # or TORCH_LOGS, TORCH_DISTRIBUTED_DEBUG, TORCHINDUCTOR_..., TMPDIR
    import torch

has that setting read under torchrun, where ``import torch`` runs after it, and ignored in a forked trainer,
where torch read the environment long before. :func:`import_time_settings` finds such writes by reading the
script's syntax (nothing of it runs); the launcher then starts the trainers as new interpreters (as
``--no-zygote``) and says why in one line, with how to keep the zygote: set them on ftrun's command line.

What counts (each a write that a forked trainer would miss):

- a write of ``os.environ`` (``os.environ[K] = V``, ``os.environ.setdefault(K, V)``, ``os.environ.update(...)``
  with a dict literal or keywords, ``os.putenv(K, V)``) whose key is a string literal read at import
  (:data:`READ_AT_IMPORT`, :data:`READ_AT_IMPORT_PREFIXES`, less :data:`READ_LATER_PREFIXES`);
- at the module's top level, also inside top-level ``if``, ``try`` and ``with`` blocks (``if __name__ ==
  "__main__":`` included, not inside functions), before its first import of anything but the standard library
  and ftrun (torch, or a module that may import it);
- unless it changes nothing: a literal value equal to the launcher's own environment's (a ``setdefault`` of a
  variable the launcher's environment has).
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

NOT_TORCH = sys.stdlib_module_names | {"ftrun"}  # imports that do not import torch (``import ftrun`` does not)
READ_AT_IMPORT = frozenset({"TMPDIR", "TEMP", "TMP"})  # tempfile caches its directory at its first use
READ_AT_IMPORT_PREFIXES = ("TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_")
# read when CUDA or a process group starts, in the trainer: a forked trainer sees them as a new one does
READ_LATER_PREFIXES = ("TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                       "TORCH_CUDA_ARCH_LIST", "TORCHELASTIC_")
ENVIRON_WORDS = (b"environ", b"putenv")  # every write this module finds names one of them


@dataclass(frozen=True)
class ImportSetting:
    """A variable the script sets before it imports torch, at ``line`` of ``path``."""

    name: str
    path: str
    line: int

    def describe(self) -> str:
        return f"{os.path.basename(self.path)}:{self.line} sets {self.name}"


def import_time_settings(target: str, module: bool, environ: Mapping[str, str]) -> list[ImportSetting]:
    """The writes of torch's import-time variables in the script ``target`` (a path, or with ``module`` a module
    name looked up from the current directory without importing anything) before its first import that is not
    of the standard library; [] when it cannot be read or parsed (Python reports that itself)."""
    path = _module_file(target) if module else _script_file(target)
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            source = f.read()
        if not any(word in source for word in ENVIRON_WORDS):
            return []  # no write of the environment: no parse (a 5 MB script parses in seconds)
        tree = ast.parse(source, path)
    except (OSError, SyntaxError, ValueError):
        return []
    found = []
    for statement in _top_level(tree.body):
        if _imports_beyond_stdlib(statement):
            break
        for node in _executed(statement):
            for name, value, default in _environ_writes(node):
                if _read_at_import(name) and not _changes_nothing(environ.get(name), value, default):
                    found.append(ImportSetting(name, path, node.lineno))
    return found


def _script_file(target: str) -> str | None:
    if os.path.isdir(target):
        target = os.path.join(target, "__main__.py")
    return target if os.path.isfile(target) else None


def _module_file(name: str) -> str | None:
    """The source file of module ``name`` (a package's ``__main__``), found on the current directory and
    ``sys.path`` without importing its packages; None when it is not a plain source file."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    parts = name.split(".")
    spec = None
    for index, part in enumerate(parts):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or []) or None
        if search is None and index < len(parts) - 1:
            return None
    if spec is not None and spec.submodule_search_locations:
        spec = importlib.machinery.PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module's statements in order, those inside top-level ``if``/``try``/``with`` blocks as their own."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _top_level(statement.body)
            yield from _top_level([s for handler in statement.handlers for s in handler.body])
            yield from _top_level(statement.orelse + statement.finalbody)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            yield from _top_level(statement.body)
        else:
            yield statement


def _executed(statement: ast.stmt) -> Iterator[ast.AST]:
    """The nodes of ``statement`` that run as it runs: not the bodies of the functions and classes it defines."""
    pending: list[ast.AST] = [statement]
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def _imports_beyond_stdlib(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Import):
        names = [alias.name for alias in statement.names]
    elif isinstance(statement, ast.ImportFrom):
        names = [statement.module or ""] if statement.level == 0 else ["."]
    else:
        return False
    return any(name.partition(".")[0] not in NOT_TORCH for name in names)


def _environ_writes(node: ast.AST) -> Iterator[tuple[str, ast.expr | None, bool]]:
    """(name, value, is a setdefault) for each write of ``os.environ`` with a literal name in ``node``."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and _is_environ(target.value) and _literal(target.slice):
                yield _literal(target.slice), node.value, False  # type: ignore[misc]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner, method = node.func.value, node.func.attr
        if _is_environ(owner) and method == "setdefault" and node.args and _literal(node.args[0]):
            yield _literal(node.args[0]), node.args[1] if len(node.args) > 1 else None, True  # type: ignore[misc]
        elif _is_environ(owner) and method == "update":
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    for key, value in zip(arg.keys, arg.values):
                        if key is not None and _literal(key):
                            yield _literal(key), value, False  # type: ignore[misc]
            for keyword in node.keywords:
                if keyword.arg is not None:
                    yield keyword.arg, keyword.value, False
        elif _is_name(owner, "os") and method == "putenv" and node.args and _literal(node.args[0]):
            yield _literal(node.args[0]), node.args[1] if len(node.args) > 1 else None, False  # type: ignore[misc]


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and _is_name(node.value, "os")) or \
        _is_name(node, "environ")


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _read_at_import(name: str) -> bool:
    return (name in READ_AT_IMPORT or name.startswith(READ_AT_IMPORT_PREFIXES)) and \
        not name.startswith(READ_LATER_PREFIXES)


def _changes_nothing(current: str | None, value: ast.expr | None, default: bool) -> bool:
    """Whether the write leaves the launcher's value (``current``) as it is."""
    if default and current is not None:
        return True
    return current is not None and _literal(value) == current
