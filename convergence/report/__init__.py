"""Reports: terminal matrix, report.json/.md/.html, PNG plots and JUnit properties.

All of them are built from :class:`convergence.run.outcome.PairOutcome` alone (the documents from
the report.json dict, so they can be rebuilt from saved outcomes). Three groups, each importing
only the ones before it (and the shared helpers :mod:`.fmt`, :mod:`.files`, :mod:`.figure`,
:mod:`.markup`):

- :mod:`.data`: the data model: per-pair records, report.json and its schema, saved outcomes.
- :mod:`.sections`: the :data:`~.sections.SECTIONS` registry: dimensions, resources,
  reduced-communication blocks, numerics probe.
- :mod:`.formats`: terminal, failure text, markdown, HTML, JUnit, plots, and the writer.
"""

from __future__ import annotations

from convergence.report.data.curves import divergence_table
from convergence.report.data.schema import (
    REPORT_JSON_SCHEMA,
    REPORT_SCHEMA_VERSION,
    build_report,
)
from convergence.report.data.serialize import outcome_from_json, outcome_to_json
from convergence.report.formats.junit import junit_properties
from convergence.report.formats.markdown import render_markdown, write_step_summary
from convergence.report.formats.terminal import matrix_rows, render_matrix
from convergence.report.formats.write import write_reports

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
