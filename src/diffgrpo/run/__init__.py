"""The job around the iterations: the run directory and its lock (``rundir``), metric rows and sample grids
(``runlog``), the experiment trackers (``trackers``), checkpoints (``checkpoint``), what a resume, ``sample`` and ``export`` take from a saved config
(``saved_config``), and the schedule of evaluations, checkpoints and outputs (``job``)."""
