"""The report's data model: what every output format is rendered from.

- :mod:`.curves`: numbers computed once from an outcome's curves (|Δ| against the reference,
  the control replicates' band, resource summaries, the divergence table).
- :mod:`.records`: one plain-data record per pair (a report.json ``pairs`` entry).
- :mod:`.schema`: the report.json document, its JSON Schema and :func:`build_report`.
- :mod:`.serialize` / :mod:`.jsonable`: PairOutcome <-> strict JSON (saved outcomes).

Imports nothing else of :mod:`convergence.report`.
"""
