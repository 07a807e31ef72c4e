"""maxout: fine-tune transformer encoders with every GPU speed-up as a measured, MLflow-logged flag.

The house, from the ground up (each room's docstring says what it holds and what it may import; a test reads
those lines and the imports, and fails on an import circle or a broken rule):

- ground floor, pure values: ``errors``, ``paths``, ``config``, ``hardware``, ``optimizations/``, ``metrics``
- inputs: ``loading`` (Hydra overrides to a typed Config), ``data``, ``modeling``
- wings: ``serving/``, ``tracking/``, ``registry/``, ``train/``, ``hpo/``, ``insight/``
- ``cli``, on top; nothing imports it

Root. May import: nothing.
"""

__version__ = "0.1.0"
