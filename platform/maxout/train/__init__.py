"""Training: ``train(cfg)`` runs one tracked fine-tuning run (run.py); the loop is in loop.py.

- ``prepare.py``: the input checks that run before any run exists
- ``setup.py``: builds the model, data loaders and optimizer, deciding and applying each optimization once
- ``loop.py``, ``callbacks.py``, ``evaluate.py``: the loop, its five hook points, evaluation (and when)
- ``selection.py``: the best evaluation's weights (train.select_best) and early stopping; ``reports.py``: the
  confusion matrix and classification report artifacts
- ``warm.py``: what one process keeps between runs on the same data (HPO trials)
- ``oom.py``: out-of-memory recovery; ``batch_finder.py`` and ``tensor_memory.py``: ``batch_size=auto``
- ``checkpointing.py``, ``resume.py``: checkpoints, and ``resume=auto``
- ``distributed.py``: the job's processes under torchrun (process group, collectives, which rank failed);
  ``sharded.py``: the whole model from FSDP's shards; ``launch.py``: ``maxout train --nproc-per-node N``
- ``run.py``: ``train(cfg)``, the params and model it logs; ``lineage.py``: its datasets, and its model's scores

Train wing. May import: errors, paths, config, hardware, optimizations, metrics, data, modeling, serving,
tracking, train. Not loading (it takes a Config, never composes one), registry, hpo, insight or cli.
"""

from .callbacks import Callback, TrainState
from .run import TrainResult, train

__all__ = ["Callback", "TrainState", "TrainResult", "train"]
