"""The one exception type that reaches the user as a single line.

Every check of user input (flags, YAML, scripts, ports, endpoints) raises :class:`UsageError`; the CLI prints
``ftrun: error: <message>`` and exits with :data:`USAGE_EXIT_CODE`, never a traceback.
"""

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, nothing started or left behind."""
