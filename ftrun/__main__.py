"""``python -m ftrun`` and the ``ftrun`` console script: a Ctrl-C while ftrun's modules load (about 0.3 s) ends
the command in one line, as one later does (:func:`ftrun.cli.main`), not with a traceback from an import."""

import signal

from ftrun.errors import stopped_while_starting


def start() -> None:
    previous = signal.signal(signal.SIGINT, stopped_while_starting)
    from ftrun.cli import main

    signal.signal(signal.SIGINT, previous)
    main()


if __name__ == "__main__":
    start()
