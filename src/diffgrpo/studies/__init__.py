"""Benchmarks as commands: per-iteration engine ratios with counters (``engines``, ``diffgrpo bench engines``) and
time to a target held-out reward inside the guards (``quality``, ``diffgrpo bench quality``)."""
