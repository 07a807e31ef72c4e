"""Serving: what a logged model needs to predict, and nothing else.

- ``inference.py``: the saved model folder (transformers model, tokenizer, ``maxout.json``) and batched
  prediction on raw text: a label and every class probability
- ``pooling.py``: per-sample pooling (last / mean / first) before the model's own head, from padded batches or
  packed rows: what training with ``model.pooling`` or packed batches uses, so the logged model predicts the same way
- ``pyfunc.py``: the MLflow pyfunc around it, which ``mlflow.pyfunc.load_model``, ``mlflow models serve`` and
  ``maxout predict`` load
- ``model_code.py``: the file MLflow logs as the model and runs to build it ("models from code": nothing pickled)

A logged model runs without a tracker, a config or a trainer: the maxout package travels inside it.

Serving wing. May import: errors, cells, serving. Not tracking, nor anything that needs a run.
"""
