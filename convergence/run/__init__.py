"""The orchestration spine, in two tiers: jobs below, pairs on top.

    jobs.py           the job level: JobRunner (launcher, device pool, run cache) runs one job
                      -- backend, seed checkpoint and cache key once per job, cached or fresh
                      launch -> SideOutcome; RunSettings; JobFailed. Knows nothing of pairs
    runner.py         the pair level: Runner (on the JobRunner) runs a pair -> controls -> test ->
                      verdicts -> numerics probe on failure -> PairOutcome
    session.py        SessionRunner: the session's one Runner, built at its first pair
    outcome.py        PairOutcome / SideOutcome: all that reports read
    judge.py          the one place a verdict is made (every front end calls judge())
    probe.py          failure localisation: probe jobs on both sides, on the job level
    resume.py         a resuming test side: two jobs, one curve, on the job level
    probe_compare.py  two probe.json files -> the first differing module / parameter

Deliberately re-exports nothing: ``convergence.report`` imports ``run.outcome`` and
``run.probe_compare`` and must not pay for the runner's imports (launch, backends, cache).
"""
