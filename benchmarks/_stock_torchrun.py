"""torchrun exactly as torch ships it, with the phase marks of benchmarks/job_fixed_cost.py:
the "before" of issue 39 (interpreter finalization, random rendezvous sleep kept)."""

from __future__ import annotations

from torch.distributed.run import main

from convergence.phase_marks import mark, process_cpu_s

if __name__ == "__main__":
    mark("agent_imported")
    try:
        main()
    finally:
        mark("agent_exit", cpu_s=process_cpu_s(children=True))
