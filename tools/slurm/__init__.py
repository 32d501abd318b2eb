"""SLURM launch: ``train.sbatch`` (sbatch script), ``hydra_env`` (Hydra callback for submitit jobs),
``local_cluster`` (a one-node loopback cluster for trying them and for CI). Guide: ``docs/operations.md``."""
