"""The model registry: trained models as registered versions, the champion moved only by a better one.

- ``client.py``: a client for a tracking URI; registered models, versions, aliases and the champion history,
  looked up with one-line errors; the table ``maxout registry list`` prints
- ``lock/``: the promotion lock, taken from the store (PostgreSQL advisory lock, a lock on the SQLite file, a bakery
  over the model's tags behind a server): one module per kind
- ``transaction.py``: the alias and history writes of one promotion, undone together if any fails
- ``promotion.py``: register a version, promote it if it beats the champion, promote or roll back by hand
- ``predict.py``: a registered model (``models:/NAME@champion``) on a CSV / JSONL / Parquet file

Registry wing. May import: errors, paths, config, cells, data, serving, tracking, registry. Not train or hpo: a model
registers the same whoever trained it.
"""
