"""Raises before doing anything: a script that is broken at import, restarted until the limit."""

raise RuntimeError("broken at import")
