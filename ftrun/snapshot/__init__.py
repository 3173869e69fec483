"""RAM snapshots: the trainer's :class:`~ftrun.snapshot.client.Snapshotter` and the node's keeper.

Nothing here imports torch at package level: the keeper (:mod:`ftrun.snapshot.keeper`) handles bytes only.
"""
