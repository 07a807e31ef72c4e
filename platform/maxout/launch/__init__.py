"""Launching the same job on a cluster: what a scheduler's own formats need, written by maxout, run by the
scheduler. maxout writes no scheduler of its own.

- ``kubernetes.py``: manifests for the MLflow Projects Kubernetes backend (``kubernetes_config.json`` and its job
  template), a multi-node training job as a Kubeflow Trainer ``TrainJob`` and as a plain Indexed Job with a
  headless Service, and HPO workers as a Job with ``parallelism: N`` on a PostgreSQL study
- ``slurm.py``: sbatch scripts for a multi-node torchrun training job (one agent per node, c10d rendezvous on the
  first node) and an HPO job array on one PostgreSQL study

Every container or job command is ``maxout train`` / ``maxout hpo`` with Hydra overrides, the commands a user runs
by hand. Credentials come from the cluster (Kubernetes Secrets, the Slurm job's environment), never from a file
maxout writes.

May import: errors.
"""
