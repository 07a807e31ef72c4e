"""Hyper-parameter search: Optuna studies whose trials are nested MLflow runs.

- ``study.py``: ``run(overrides)``, one worker's share of a study under one parent run
- ``objective.py``: one trial, one nested child run; pruning per epoch or per fold
- ``search_space.py``: the typed search space, checked against the real config before any trial
- ``storage.py``: where the study lives (a journal file, or PostgreSQL for many workers), and lost-worker retries
- ``supervisor.py``: ``hpo.workers`` > 1, N worker processes of the study on this machine; ``placement.py``: each
  worker's share of the device; ``auto_workers.py`` + ``probe.py``: N measured for ``hpo.workers=auto``
- ``folds.py``: stratified k-fold; ``report.py``: what the parent run gets at the end

The typed ``hpo`` config section lives with the rest of the config (config.py).

HPO wing. May import: errors, paths, config, hardware, optimizations, metrics, loading, data, modeling, tracking,
registry, train, hpo. Not insight or cli.
"""
