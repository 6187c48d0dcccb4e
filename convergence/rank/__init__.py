"""What runs inside a training rank, for any trainer: the pieces the built-in trainer
(convergence/trainer/) and the torchtitan launcher (convergence/backends/torchtitan/) share, so
that neither imports the other's internals and both measure with the same definitions.

- hooks.py: the user's hook (HookContext, loading and applying it; found at collection without
  importing it: torch-free at its top, as is rounding_draw.py, which the plugin reads);
- rounding_draw.py: another machine's rounding (``CONVERGENCE_ROUNDING_DRAW``);
- sample_hash.py: the per-sample hash the data fingerprint sums;
- norms.py: the full-tensor gradient and update norms, per part of the model;
- meshes.py: the sub-meshes a rank-side helper reads (``Meshes``), built by each trainer;
- probe_norms.py: what the numerics probe records on a rank and reduces, layout independent.

Below the trainer in tests/test_layers.py: it imports only spec/ and the standard library of
the package, and third-party packages (torch) where a module needs them.
"""
