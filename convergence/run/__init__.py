"""The orchestration spine: a pair -> seed checkpoint -> jobs (cache or launch) -> verdicts ->
numerics probe on failure -> PairOutcome.

    runner.py         Runner (one per session: launcher, device pool, run cache) and its seam
                      for cached runs; RunSettings; JobFailed
    session.py        SessionRunner: the session's one Runner, built at its first pair
    outcome.py        PairOutcome / SideOutcome: all that reports read
    probe.py          failure localisation: probe jobs on both sides, cached through the Runner
    probe_compare.py  two probe.json files -> the first differing module / parameter

Deliberately re-exports nothing: ``convergence.report`` imports ``run.outcome`` and
``run.probe_compare`` and must not pay for the runner's imports (launch, backends, cache).
"""
