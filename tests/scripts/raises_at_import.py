"""Raises before doing anything: a script that is broken at import, restarted until the limit. Its message names
the generation, so it does not fail the same way twice (that would end the job as a crash loop)."""

import os

raise RuntimeError(f"broken at import (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
