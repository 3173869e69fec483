"""A restored data loader's resume iterator must not draw from the RNG the snapshot restored.

Making a ``DataLoader`` iterator draws its base seed (the seed of its workers): one ``int64`` from
``loader.generator``, the global torch RNG when that is None. After a restore, torchdata's StatefulDataLoader
makes a resume iterator and replaces that base seed by the one in its state; but the draw has moved the RNG one
step past the restored state, so dropout and every random number after it differ from the run without failure,
which made no iterator at that step.

:class:`LoaderSeedGuard` gives every stateful DataLoader of the restored state a throwaway generator for the
*resume window*, from the restore to the end of the first optimizer step after it, so that draw leaves the RNG
alone, and then puts the loader's own generator back. Invariant: outside the window every loader has its own generator.

Limit: a snapshot of the last step of an epoch resumes with an iterator at its end. The script then makes the
next epoch's iterator inside the window, and the throwaway serves that draw too, which in the run without
failure came from the RNG. ftrun cannot tell the two draws apart before the step; it warns after it (on rank 0).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader


class LoaderSeedGuard:
    """Throwaway generators for the stateful data loaders in ``state`` until :meth:`release`."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._swapped: list[tuple[str, DataLoader, torch.Generator | None, torch.Generator]] = []
        for path, loader in _stateful_loaders(state, ""):
            throwaway = torch.Generator().manual_seed(0)
            self._swapped.append((path, loader, loader.generator, throwaway))
            loader.generator = throwaway

    def release(self) -> None:
        """Give every loader its own generator back; warn where a throwaway served more than one draw."""
        unused = torch.Generator().manual_seed(0)
        once = torch.Generator().manual_seed(0)
        torch.empty((), dtype=torch.int64).random_(generator=once)
        for path, loader, own, throwaway in self._swapped:
            if loader.generator is throwaway:
                loader.generator = own
            drawn = throwaway.get_state()
            if os.environ.get("RANK", "0") == "0" and not (torch.equal(drawn, unused.get_state())
                                                         or torch.equal(drawn, once.get_state())):
                print(f"ftrun: {path}: restored at the end of its epoch, the data loader began its next epoch "
                      "before the first step; its workers' seed and the RNG may differ from the run without "
                      "failure from here on", file=sys.stderr, flush=True)
        self._swapped.clear()


def _stateful_loaders(value: Any, path: str) -> Iterator[tuple[str, DataLoader]]:
    if isinstance(value, DataLoader):
        if callable(getattr(value, "load_state_dict", None)):
            # accelerate's prepared loader (DataLoaderShard) passes for the StatefulDataLoader it wraps, reads its
            # attributes through to it but keeps those set on it: the wrapped loader draws the seed
            yield path, getattr(value, "base_dataloader", value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _stateful_loaders(item, f"{path}/{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _stateful_loaders(item, f"{path}/{index}")
