"""Launching jobs: torchrun (local) or srun+torchrun (Slurm), device pool, watchdog."""
