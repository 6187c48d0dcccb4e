"""The built-in reference trainer: ``torchrun ... -m convergence.trainer --config X.toml``.

See train.py for the loop, convergence/rank/hooks.py for the user extension point and model.py
for the model.
"""
