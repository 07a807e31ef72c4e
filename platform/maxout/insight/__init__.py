"""Insight: measurements that answer "are we maxed out?" for a config on this machine.

- ``hardware_report.py``: ``maxout check-hardware``, what the device offers (or why not), what ``hardware=auto``
  picks, the micro-batch to use
- ``charts.py``: the bar chart of ratios per cell that the benchmark and the audit draw (no torch)
- ``benchmark.py``: ``maxout benchmark``, an ablation grid as nested MLflow runs, a table and charts
- ``grid.py``: the grid's axes and cells (pure values: the CLI's help lists the axes without loading torch)
- ``audit.py``: ``maxout audit``, the measured verdict for the user's own config: where the time goes, what each
  lever buys (paired runs, both orders), the fastest combination, within a time budget; ``levers.py`` the table of
  levers it considers, ``breakdown.py`` the instrumented probe of a step, ``audit_report.py`` its report

Insight wing. May import: errors, paths, config, hardware, optimizations, metrics, loading, data, modeling,
tracking, train, insight. Not registry, hpo or cli.
"""
