"""The one exception type that reaches the user as a single line, and how other errors read in one.

Every check of user input (flags, YAML, scripts, ports, endpoints) raises :class:`UsageError`; the CLI prints
``ftrun: error: <message>`` and exits with :data:`USAGE_EXIT_CODE`, never a traceback.
"""

import os
import re
import reprlib
import sys
from collections.abc import Iterable

USAGE_EXIT_CODE = 2
SHORT = reprlib.Repr()  # a value shown in an error: bounded however large (an anchor bomb, a pasted file) it is
SHORT.maxlevel, SHORT.maxlist, SHORT.maxdict, SHORT.maxstring, SHORT.maxother = 2, 4, 4, 60, 60
LONG_VALUE = 200  # characters: a value of the command line or the environment longer than this is cut in errors
# numbers in a failure's message, but not an IPv4 address (another peer is another failure; its port is not)
_NUMBER = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3})|0x[0-9a-fA-F]+|\d+")


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, nothing started or left behind."""


def natural(text: str) -> int | None:
    """The non-negative integer ``text`` spells in ASCII digits, else None: ``str.isdigit`` also accepts digits
    that ``int`` does not read (``²``), and ``int`` refuses more digits than ``sys.get_int_max_str_digits()`` (4300),
    both with a ValueError."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= sys.get_int_max_str_digits() else None


def error_line(message: str, given: Iterable[str]) -> str:
    """``ftrun: error: <message>``, the line bad input gets, with every long value it shows cut as :data:`SHORT`
    cuts a long string (a YAML key's bad value is): a 5000-character flag value was echoed whole. Long: more than
    :data:`LONG_VALUE` characters, a value of ``given`` (the command line's arguments, ``--flag=value``'s value, the
    environment's values) as given or as ``repr`` shows it, and any run of characters without a space (a piece of
    such a value). A line break a value brings in shows as ``\\n``: the error stays one line."""
    values = {part for value in given for part in (value, value.partition("=")[2]) if len(part) > LONG_VALUE}
    for value in sorted(values, key=len, reverse=True):  # a long value inside a longer one: the longer one first
        message = message.replace(value, _cut(value)).replace(repr(value)[1:-1], _cut(repr(value)[1:-1]))
    message = re.sub(rf"\S{{{LONG_VALUE + 1},}}", lambda run: _cut(run[0]), message)
    return "ftrun: error: " + message.replace("\r", "\\r").replace("\n", "\\n")


def _cut(text: str) -> str:
    """``text``'s start and end around ``...``, :data:`SHORT`'s ``maxstring`` characters in all."""
    head = (SHORT.maxstring - 3) // 2
    return text[:head] + "..." + text[len(text) - (SHORT.maxstring - 3 - head):]


def error_text(err: BaseException) -> str:
    """An error's text for a one-line message: an OSError's reason with the file it names (``No space left on
    device (/ckpt/job/.step-00000040.partial/rank-00003.snap)``), else its own text."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({err.filename})" if err.filename else err.strerror
    return str(err)


def same_failure(signature: str, earlier: str) -> bool:
    """Whether two failures' signatures (``Type: message``) say the same, numbers aside: a peer's port, a pid, a
    memory address, a step or a loss value in the message change from one run to the next of one failure (an
    IPv4 address counts: the same failure with another peer may be a transient one)."""
    return bool(signature.strip()) and _masked(signature) == _masked(earlier)


def _masked(text: str) -> str:
    return _NUMBER.sub(lambda found: found[1] or "#", text.strip())


def stopped_while_starting(signum: int, frame: object) -> None:
    """SIGINT handler of the ``ftrun`` command before it starts anything (its imports, its checks, until the
    launcher's exec holds the signal): one line and exit code 130, not a traceback; nothing to clean up."""
    sys.stderr.write("ftrun: stopped by SIGINT while the job was starting\n")
    sys.stderr.flush()
    os._exit(130)  # no import or library in between may catch it, and nothing needs finalizing
