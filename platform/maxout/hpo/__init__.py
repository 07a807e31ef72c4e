"""Hyper-parameter search: Optuna studies whose trials are nested MLflow runs (see study.py).

This package's ``__init__`` stays light (no optuna import): config.py imports the typed ``hpo`` section from
settings.py on every load.
"""
