"""Packed, resumable batches of a token stream (``data.corpus`` makes the streams).

``PackedBatches`` cuts a stream into non-overlapping windows of ``seq_len + 1`` tokens and walks a per-epoch
permutation of them; its only state is ``consumed_samples``. ``val_batches`` cuts the validation stream into
the first ``max_batches`` batches, in order.
"""
from __future__ import annotations

import numpy as np
import torch

from errors import ConfigError


def _windows(tokens: np.ndarray, idx, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[i * seq_len:i * seq_len + seq_len + 1]) for i in idx]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class PackedBatches:
    """Deterministic, resumable stream of packed training sequences for one data-parallel rank.

    Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; epoch e visits the windows in the order of
    ``torch.randperm(N, generator=manual_seed(seed + e))``; global batch k is positions
    ``[k*G, (k+1)*G)`` of the concatenated epoch orders, and rank r gets rows ``[r*b, (r+1)*b)``, b = G // dp_size.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch_size % dp_size != 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) is not divisible by dp_size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.tokens, self.seq_len, self.global_batch_size = tokens, int(seq_len), int(global_batch_size)
        self.seed, self.dp_rank, self.dp_size = int(seed), int(dp_rank), int(dp_size)
        n = max(0, (len(tokens) - 1) // self.seq_len)
        if n < self.global_batch_size:
            raise ConfigError(f"data.seq_len: the training stream ({len(tokens)} tokens) gives only {n} windows of "
                              f"data.seq_len+1={self.seq_len + 1} tokens, fewer than train.global_batch_size="
                              f"{self.global_batch_size}; lower data.seq_len or train.global_batch_size, or add data")
        self._n = n
        self.consumed_samples = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_samples(self) -> int:
        return self._n

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self._n

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = torch.randperm(self._n, generator=g).numpy()
        return self._perms[epoch]

    def next_batch(self, global_batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch (``global_batch_size`` sequences, default the
        constructor's; a batch-size ramp passes the step's own)."""
        g = self.global_batch_size if global_batch_size is None else int(global_batch_size)
        if g % self.dp_size:
            raise ValueError(f"global batch {g} is not divisible by dp_size {self.dp_size}")
        start = self.consumed_samples + self.dp_rank * (g // self.dp_size)
        idx = [self._perm(p // self._n)[p % self._n] for p in range(start, start + g // self.dp_size)]
        self.consumed_samples += g
        return _windows(self.tokens, idx, self.seq_len)

    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.consumed_samples), "seed": self.seed, "num_samples": self._n,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, sd: dict) -> None:
        """Resume; raises ConfigError (one line, naming the key) if the saved stream had a different seed or
        window count (other data): its position would index a different order."""
        fresh = "or start a new run with checkpoint.resume=none or another checkpoint.dir"
        if sd.get("kind") == "blend":
            raise ConfigError(f"data.blend: the checkpoint was trained on token datasets (data.blend), this run reads a "
                              f"text corpus; resume with the checkpoint's data settings, {fresh}")
        if "seed" in sd and int(sd["seed"]) != self.seed:
            raise ConfigError(f"train.seed: the checkpoint was written with train.seed={int(sd['seed'])}, this run has "
                              f"train.seed={self.seed} (the seed fixes the data order, so the checkpoint's data position "
                              f"means other batches); resume with train.seed={int(sd['seed'])}, {fresh}")
        if "num_samples" in sd and int(sd["num_samples"]) != self._n:
            raise ConfigError(f"data.path: the checkpoint's training stream has {int(sd['num_samples'])} windows, this "
                              f"run's has {self._n} (data.path, data.tokenizer, data.seq_len or data.val_fraction "
                              f"changed); resume with the checkpoint's data settings, {fresh}")
        self.consumed_samples = int(sd["consumed_samples"])


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``max_batches`` full batches of consecutive windows, in stream order (same packing as
    training). If the split has fewer windows than one batch, a single smaller batch of all of them;
    no windows at all -> []. ``max_batches <= 0`` means all full batches."""
    n = max(0, (len(tokens) - 1) // seq_len)
    if n == 0:
        return []
    if n < batch_size:
        return [_windows(tokens, range(n), seq_len)]
    n_batches = n // batch_size if max_batches <= 0 else min(max_batches, n // batch_size)
    return [_windows(tokens, range(k * batch_size, (k + 1) * batch_size), seq_len) for k in range(n_batches)]
