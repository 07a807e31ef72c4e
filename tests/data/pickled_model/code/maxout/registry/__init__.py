"""The model registry: trained models as registered versions, the champion moved only by a better one.

- ``client.py``: a client for a tracking URI; registered models, versions, aliases and the champion history,
  looked up with one-line errors; the table ``maxout registry list`` prints
- ``lock.py``: the promotion lock (a ticket queue kept in the registry itself) and the alias transaction
- ``promotion.py``: register a version, promote it if it beats the champion, promote or roll back by hand
- ``predict.py``: a registered model (``models:/NAME@champion``) on a CSV / JSONL / Parquet file

Registry wing. May import: errors, paths, config, cells, data, serving, tracking, registry. Not train or hpo: a model
registers the same whoever trained it.
"""
