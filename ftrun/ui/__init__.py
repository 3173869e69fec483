"""Live status of a job: the model gathered from the control store (:mod:`ftrun.ui.status`) and its views."""
