"""Planted parallelism bugs for the detection benchmark (benchmarks/detection/run.py).

Every bug is a parallelism hook (``hook = "detection_bugs.<module>:<function>"``, see
convergence/trainer/hooks.py) that the trainer imports and applies on every rank. Each one is
wrong the way a real bug is wrong; the docstring of each function says which real bug it
stands for and what it does to the gradient, the loss and the grad norm. The ``correct``
module holds correct twins that use the same mechanisms (must pass).

The ranks import this package: its parent folder (benchmarks/detection) must be on their
``PYTHONPATH`` (run.py and tests/test_detection.py put it there).
"""
