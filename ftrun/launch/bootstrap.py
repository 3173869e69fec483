"""How a trainer runs the user's code: as ``python script.py`` (or ``python -m module``) would.

Used in a trainer forked by the zygote (:func:`run_main`, from :mod:`ftrun.launch.zygote`) and, with
``--no-zygote``, as the trainer's own program: ``python -u -P -m ftrun.launch.bootstrap [-m] TARGET ARGS...``
(``-P``: the user's cwd never shadows ftrun; :func:`run_main` puts the ``sys.path[0]`` Python would).

An uncaught exception is reported as Python reports it, with the user's frames only: the leading frames of
ftrun and runpy that led to the user's code are dropped from its traceback (:func:`user_traceback`) and
``sys.excepthook`` prints it (one the script installed, or Python's), then the process exits 1. A
``SystemExit`` is left alone (Python exits with its code, silently), and a ``KeyboardInterrupt`` ends the
process as Python ends it (by SIGINT, after the clean traceback).

An exception is also written to ``TORCHELASTIC_ERROR_FILE`` in torchelastic's format (unless the script's
``@record`` already wrote it); its ``Type: message`` is what the supervisor reports and the signature it
compares to tell a crash loop (:mod:`ftrun.launch.supervisor`). A trainer started after a failure before the
first step gets that failure in :data:`ENV_EARLY_FAILURE`; if it fails the same way, it prints one line
instead of the same traceback again. Where torch is imported already (a zygote's trainer), DDP modules are
recorded as the script builds them (:func:`~ftrun.snapshot.ddp_buckets.track_ddp_modules`).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from types import TracebackType

from ftrun.control.heartbeat import training_over
from ftrun.errors import same_failure
from ftrun.launch.as_main import NotRunnable, run_as_main

ENV_EARLY_FAILURE = "FTRUN_EARLY_FAILURE"  # {"generation": G, "signature": "Type: message"}, set by the supervisor
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ftrun's own frames: under this folder
_RUNPY = os.path.abspath(runpy.__file__)  # when runpy is not frozen ("<frozen runpy>")


def _launcher_frame(filename: str) -> bool:
    """Whether a frame of this file is ftrun's or runpy's (what leads to the user's code)."""
    if filename.startswith("<"):
        return filename == "<frozen runpy>"
    path = os.path.abspath(filename)
    return path == _RUNPY or path.startswith(_PACKAGE + os.sep)


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the user's first frame on: without the leading frames of ftrun and runpy (None when no frame
    is the user's, as for a SyntaxError in the script)."""
    while tb is not None and _launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def signature(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, as torchelastic's ``@record`` writes it in the error file."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        text = "<exception str() failed>"
    return f"{type(exc).__name__}: {text}"


def clean_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` as ``python script.py`` prints it (chained exceptions included), user frames
    only."""
    return "".join(traceback.TracebackException(type(exc), exc, user_traceback(exc.__traceback__)).format())


def write_error_file(exc: BaseException, path: str | None) -> None:
    """Record ``exc`` in torchelastic's error-file format at ``path``, unless the file exists (the script's
    ``@record`` wrote it first)."""
    if not path:
        return
    data = {"message": {"message": signature(exc),
                        "extraInfo": {"py_callstack": clean_traceback(exc), "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "x") as f:
            json.dump(data, f)
    except OSError:
        pass


def _same_as_earlier(sig: str, earlier: str | None) -> int | None:
    """The generation whose early failure ``sig`` repeats (from :data:`ENV_EARLY_FAILURE`), or None."""
    try:
        doc = json.loads(earlier or "")
        return int(doc["generation"]) if same_failure(sig, str(doc["signature"])) else None
    except (ValueError, TypeError, KeyError):
        return None


def _flush(stream: object) -> None:
    try:
        stream.flush()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - closed, None or broken: nothing to flush
        pass


def _print_exception(exc: BaseException, tb: TracebackType | None) -> None:
    """Print as Python prints an uncaught exception: with ``sys.excepthook`` (and its fallback when it fails). Python's
    own hook is given the text in one write, not piece by piece: ranks failing at the same moment (all of them, at
    import) print their tracebacks whole, not interleaved a few characters at a time."""
    _flush(sys.stdout)
    if sys.excepthook is sys.__excepthook__:
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb)))
        _flush(sys.stderr)
        return
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:  # noqa: BLE001 - Python's own behaviour for a failing hook
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error, user_traceback(hook_error.__traceback__))
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)
    _flush(sys.stderr)


def run_main(target: str, args: list[str], module: bool) -> None:
    """Run ``target`` (a script path, or a module name with ``module``) as ``__main__`` with ``args``, in the
    current directory (:func:`~ftrun.launch.as_main.run_as_main`); returns when it returns, raises SystemExit
    when it fails (see the module docstring)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    earlier = os.environ.pop(ENV_EARLY_FAILURE, None)  # for this code only, not the user's (nor its children)
    if error_file:
        try:
            os.unlink(error_file)  # one left by an earlier run of the job with the same log dir
        except OSError:
            pass
    sys.argv = [target, *args]
    if "torch" in sys.modules:  # a zygote's trainer: record DDP modules for exact resumption, at no import cost
        from ftrun.snapshot.ddp_buckets import track_ddp_modules

        track_ddp_modules()
    try:
        try:
            run_as_main(target, module)
        finally:  # before Python joins the script's threads and runs its atexit handlers (a last upload)
            training_over()
    except SystemExit as exc:
        if not isinstance(exc.code, (int, type(None))):  # sys.exit("message"): Python prints it, exit code 1
            write_error_file(exc, error_file)  # so that the failure line says it too
        raise
    except BaseException as exc:
        tb = user_traceback(exc.__traceback__)
        exc.__traceback__ = tb
        if isinstance(exc, Exception):
            write_error_file(exc, error_file)
        repeated = _same_as_earlier(signature(exc), earlier)
        if repeated is not None:
            _flush(sys.stdout)
            first = signature(exc).strip().splitlines()[0][:300]
            sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: same failure as generation {repeated}: {first} "
                             "(traceback above)\n")  # one write: whole beside other ranks' lines
            _flush(sys.stderr)
        elif isinstance(exc, NotRunnable) and tb is None:
            _flush(sys.stdout)
            print(f"{sys.executable}: {exc}", file=sys.stderr, flush=True)  # no such module: as `python -m`
        else:
            _print_exception(exc, tb)
        if isinstance(exc, KeyboardInterrupt):
            # Python ends an uncaught KeyboardInterrupt by SIGINT, after finalizing; it is printed already
            sys.excepthook = lambda *_: None
            raise
        raise SystemExit(1) from None


def main() -> None:
    args = sys.argv[1:]
    module = bool(args) and args[0] == "-m"
    if module:
        args = args[1:]
    if not args:
        sys.exit("usage: python -P -m ftrun.launch.bootstrap [-m] TARGET [ARGS...]")
    run_main(args[0], args[1:], module)


if __name__ == "__main__":
    main()
