"""Reports: terminal matrix, report.json/.md/.html, PNG plots and JUnit properties.

All of them are built from :class:`convergence.outcome.PairOutcome` alone (the documents from
the report.json dict, so they can be rebuilt from saved outcomes).
"""

from __future__ import annotations

from convergence.report.junit import junit_properties
from convergence.report.markdown import render_markdown, write_step_summary
from convergence.report.matrix import matrix_rows, render_matrix
from convergence.report.schema import REPORT_JSON_SCHEMA, REPORT_SCHEMA_VERSION, build_report
from convergence.report.serialize import outcome_from_json, outcome_to_json
from convergence.report.write import divergence_table, write_reports

__all__ = [
    "REPORT_JSON_SCHEMA",
    "REPORT_SCHEMA_VERSION",
    "build_report",
    "divergence_table",
    "junit_properties",
    "matrix_rows",
    "outcome_from_json",
    "outcome_to_json",
    "render_markdown",
    "render_matrix",
    "write_reports",
    "write_step_summary",
]
