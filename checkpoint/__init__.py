"""Checkpoints, below the trainer: ``CheckpointManager`` saves with torch's DCP into a temp dir, writes a manifest of
every file's size and sha256 last and renames the dir into place; loading verifies the manifest and skips damaged
checkpoints (``manager``); names, manifests, verification, the non-finite check and the errors (``integrity``);
DCP's writer and reader with fsync and one-line errors (``files``). ``python -m checkpoint DIR`` verifies by hand.

The public API, used by ``trainer/`` and ``tools/``; everything else is private to this package.
"""
from .integrity import (CheckpointDirError, CheckpointError, CheckpointWriteError, DamagedCheckpointError,
                        NoGoodCheckpointError, NonFiniteStateError, first_nonfinite, has_state, state_keys,
                        step_dir_name, verify_local)
from .manager import HEALTH, CheckpointManager, write_manifest, written_healthy

__all__ = ["HEALTH", "CheckpointManager", "written_healthy", "CheckpointError", "CheckpointDirError", "CheckpointWriteError",
           "DamagedCheckpointError", "NoGoodCheckpointError", "NonFiniteStateError", "first_nonfinite", "has_state",
           "state_keys", "step_dir_name", "verify_local", "write_manifest"]
