"""The control plane: the store interface and its hosting, the coordination keys, the job spec, the job secret
and the values it signs, fault specs, and the trainers' heartbeat table. Below :mod:`ftrun.snapshot` and
:mod:`ftrun.launch`; it imports neither."""
