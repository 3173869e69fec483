"""How :mod:`ftrun.dcp` keeps the items of one rank's ``dcp.save`` as a Snapshotter state, and back.

The state (:func:`stored`) is ``{"format": FORMAT, "world", "planner", "chunks", "tensors", "objects"}``:

* ``world``: the world size that saved; ``planner``: the save plan's ``planner_data`` (DCP's flattening map);
* ``chunks``: one JSON string, for each tensor chunk keyed by a string of its ``MetadataIndex``
  (``fqn@o0,o1``, :func:`key`), ``[fqn, at, sizes, size, dtype]``: where the chunk sits in the global tensor of
  ``size``; one string, so a save walks one node for all of them;
* ``tensors``: the chunks (plain local tensors) under the same keys, in a
  :class:`~ftrun.snapshot.layout.Borrowed` dict (the Snapshotter copies them without cloning);
* ``objects``: ``{fqn: [fqn, value]}``, every other item, the value itself (kept as JSON by the layout, never
  pickled).

An *item* (:func:`items`) is ``{"fqn", "at", "sizes", "size", "dtype", "t"}`` for a tensor chunk, ``{"fqn",
"obj"}`` for an object. :mod:`ftrun.snapshot.export` reads the same state from a persisted step.
"""

from __future__ import annotations

import json
from typing import Any

from ftrun.snapshot.layout import Borrowed

FORMAT = "ftrun.dcp/2"


def key(fqn: str, offset: Any) -> str:
    """The key of an item: ``fqn`` for an object (``offset`` None), ``fqn@o0,o1`` for a tensor chunk."""
    return fqn if offset is None else f"{fqn}@{','.join(map(str, offset))}"


def stored(world: int, planner_data: Any, items: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The Snapshotter state holding ``items`` (by key)."""
    chunks = {k: [d["fqn"], d["at"], d["sizes"], d["size"], d["dtype"]] for k, d in items.items() if "t" in d}
    return {"format": FORMAT, "world": world, "planner": planner_data,
            "chunks": json.dumps(chunks, separators=(",", ":")),
            "tensors": Borrowed({k: d["t"] for k, d in items.items() if "t" in d}),
            "objects": {k: [d["fqn"], d["obj"]] for k, d in items.items() if "t" not in d}}


def items(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`stored`: the items by key (``state`` as restored or read back with ``to_plain``)."""
    out = {k: {"fqn": fqn, "obj": obj} for k, (fqn, obj) in state["objects"].items()}
    for k, (fqn, at, sizes, size, dtype) in json.loads(state["chunks"]).items():
        out[k] = {"fqn": fqn, "at": at, "sizes": sizes, "size": size, "dtype": dtype, "t": state["tensors"][k]}
    return out
