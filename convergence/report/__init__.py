"""Reports: terminal matrix, report.json/.md/.html and plots."""
