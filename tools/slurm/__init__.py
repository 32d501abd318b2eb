"""SLURM launch: ``train.sbatch`` (sbatch script), ``hydra_env`` (Hydra callback for submitit jobs),
a one-node loopback cluster for trying them lives with the tests (``tests/local_cluster.py``). Guide: ``docs/operations.md``."""
