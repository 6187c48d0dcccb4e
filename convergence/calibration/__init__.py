"""Noise floors measured on the user's hardware (``convergence calibrate``), and which floors a
verdict uses.

The paired and twin defaults (stats/paired_band.py, stats/twin_envelope.py) were calibrated on CPU. A GPU
rounds differently per shape (cuBLAS split-K, flash attention), so a correct pair can leave a
CPU-sized band there. ``convergence calibrate`` measures the floors on the machine at hand and
writes them to a file keyed by the hardware and software stack (stack.py, file.py); a session
whose stack matches a file uses it, else the shipped defaults, and every paired/twin verdict
says which (select.py). measure.py turns curves into floors; the runs themselves are
convergence/calibration_runs.py's (they need the Runner, a layer above the statistics).
"""
