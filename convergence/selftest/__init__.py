"""``convergence selftest``: the suite's power on the user's own experiment (catalogue bugs
planted on each of its layouts, run against its own control); see run.py."""
