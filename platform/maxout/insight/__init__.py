"""Insight: measurements that answer "are we maxed out?" for a config on this machine.

- ``hardware_report.py``: ``maxout check-hardware``, what the device offers (or why not), what ``hardware=auto``
  picks, the micro-batch to use
- ``benchmark.py``: ``maxout benchmark``, an ablation grid as nested MLflow runs, a table and charts
- ``grid.py``: the grid's axes and cells (pure values: the CLI's help lists the axes without loading torch)

Insight wing. May import: errors, paths, config, hardware, optimizations, metrics, loading, data, modeling,
tracking, train, insight. Not registry, hpo or cli.
"""
