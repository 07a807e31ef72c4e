"""Tracking: every run's params, metrics, tags, artifacts and model go through the small Tracker interface.

- ``tracker.py``: the Tracker protocol, the null tracker, ``start`` and ``closing``
- ``mlflow_run.py``: the MLflow tracker (batched, spooled writes)
- ``store.py``: which store a run goes to (URI resolution, the embedded store) and whether it answers
- ``preflight.py``: the store and artifact-store checks made before a run exists
- ``spool.py``: the write-ahead journal that keeps a run's writes through a server outage, and replay
- ``params.py``: the param naming scheme (``cfg.*``, ``device.*``), one flatten for every run
- ``datasets.py``: a run's dataset inputs and its logged model's name, as plain values (no mlflow import)
- ``redact.py``: credentials never reach params, tags or logs

This ``__init__`` imports nothing: ``from maxout.tracking import redact`` must not load mlflow.

Tracking wing. May import: errors, paths, config, hardware, tracking, serving (the model an MLflow run logs is
serving's pyfunc). Not registry, train, hpo, insight or cli.
"""
