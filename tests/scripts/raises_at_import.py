"""Raises before doing anything: a script that is broken at import, restarted until the limit. Its message names
the generation in a word, so it does not fail the same way twice (that would end the job as a crash loop; numbers
in messages do not count)."""

import os

restart = ("zero", "one", "two", "three", "four")[int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))]
raise RuntimeError(f"broken at import (restart {restart})")
