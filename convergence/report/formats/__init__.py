"""The report's output formats, each rendered from the data model (:mod:`..data`) and the
sections (:mod:`..sections`):

- :mod:`.terminal`: the matrix and the per-dimension block (plugin and CLI summary).
- :mod:`.failure_text`: a failed or broken pair as text (pytest's failure section, compare).
- :mod:`.markdown`: report.md and the GitHub step summary.
- :mod:`.html`: the self-contained report.html.
- :mod:`.junit`: a pair's JUnit properties.
- :mod:`.plots`: the per-pair PNGs and the heatmap, and their file names.
- :mod:`.write`: every file of a report folder, each written atomically.
"""
