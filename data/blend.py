"""Weighted blends of memory-mapped token datasets, served as packed windows: deterministic, resumable, and
independent of the data-parallel size.

A *source* is anything with ``num_tokens`` and ``read(start, stop)`` (``data.shards.TokenSource``: our
shards or a Megatron-LM ``.bin/.idx`` dataset). Source j has ``n_j = (num_tokens - 1) // seq_len`` windows;
window w is ``read(w*L, w*L + L + 1)`` (inputs and shifted labels), as in ``data.PackedBatches``.

The sample sequence is a pure function of the global sample index i (so a resume, under any dp size,
continues it exactly):

* **which source**: a fixed pattern of ``CHUNK`` slots is filled greedily (slot p goes to the source
  furthest below its share ``weight * (p + 1)``), then repeated. Every prefix of the pattern is within one
  sample per source of the weights; the per-source position of sample i is ``c * count_j + prefix[p]``
  (chunk c, slot p), so nothing is scanned.
* **which window**: the source's k-th sample is window ``perm_(j, epoch)(k mod n_j)``, epoch = k // n_j,
  where ``perm`` is a keyed Feistel permutation (``feistel_permute``): O(1) memory whatever the corpus size
  (a stored shuffle of 3.6B windows would take 29 GB).

Global batch b covers samples ``[consumed, consumed + B_b)``; data-parallel rank r reads rows
``[r * B_b/dp, (r+1) * B_b/dp)``. ``B_b`` may change from step to step (``train.batch_ramp``); the only
state is ``consumed_samples`` (and the settings it is checked against).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from errors import ConfigError

from .batches import val_batches

CHUNK = 1 << 14          # slots of the repeating source pattern: shares exact to 1/CHUNK
_ROUNDS = 4
_M64 = np.uint64((1 << 64) - 1)
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ permutation
def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finaliser) of ``x ^ key``; arrays of uint64, wrapping arithmetic."""
    with np.errstate(over="ignore"):
        z = x ^ np.uint64(key)
        z = (z + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def feistel_permute(idx: np.ndarray, n: int, key: int) -> np.ndarray:
    """Image of positions ``idx`` (< n) under a pseudo-random permutation of ``range(n)`` chosen by ``key``.

    A balanced Feistel network on ``2h`` bits (4**h >= n) is a bijection of ``range(4**h)``; cycle walking
    (apply it again while the value is >= n) restricts it to a bijection of ``range(n)``. At most 4n > 4**h, so
    a walk takes fewer than 4 applications on average."""
    idx = np.asarray(idx, dtype=np.uint64)
    if n <= 1:
        return idx.astype(np.int64)
    h = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << h) - 1)
    keys = [_key(key, r) for r in range(_ROUNDS)]

    def once(x):
        left, right = x >> np.uint64(h), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << np.uint64(h)) | right

    out = once(idx)
    todo = np.nonzero(out >= n)[0]
    while todo.size:
        out[todo] = once(out[todo])
        todo = todo[out[todo] >= n]
    return out.astype(np.int64)


# ----------------------------------------------------------------------------------------------- blend
def source_pattern(weights: list[float], chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (source of each slot, index of the slot among its source's slots, slots per source) for one chunk."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    src = np.empty(chunk, dtype=np.int64)
    prefix = np.empty(chunk, dtype=np.int64)
    for p in range(chunk):
        j = int(np.argmax(w * (p + 1) - counts))
        src[p], prefix[p] = j, counts[j]
        counts[j] += 1
    return src, prefix, counts


@dataclass(frozen=True)
class Sample:
    source: int     # index into the blend
    window: int     # window of that source


class BadDocument(ConfigError):
    """A token id outside the model's vocabulary in a training or validation window (``data.on_bad_document``)."""


def first_bad(row, vocab_size: int) -> int | None:
    """Index of the first token id outside ``[0, vocab_size)`` in a window (numpy or torch), or None."""
    bad = ((row < 0) | (row >= vocab_size)).nonzero()[0]
    return int(bad[0]) if len(bad) else None


def bad_token(key: str, name: str, src, pos: int, token: int, vocab_size: int) -> tuple[str, int]:
    """(one line naming a bad token: source, shard file, document and position (``TokenSource.locate``); the
    document, or the stream position for a source that cannot locate it)."""
    if hasattr(src, "locate"):
        shard, doc, at = src.locate(pos)
        place = f"{shard}, document {doc}, position {at}"
    else:
        doc, place = pos, f"token {pos} of the stream"
    return f"{key}: source {name}: token id {token} outside model.vocab_size={vocab_size} at {place}", doc


class BlendedBatches:
    """Resumable stream of packed training windows from weighted sources, for one data-parallel rank."""

    def __init__(self, sources, weights: list[float], names: list[str], seq_len: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, key: str = "data.blend", vocab_size: int | None = None,
                 on_bad_document: str = "error"):
        if len(sources) != len(weights) or not sources:
            raise ValueError("one weight per source, at least one source")
        self.sources, self.names, self.key = list(sources), list(names), key
        self.vocab_size, self.on_bad_document = vocab_size, on_bad_document
        self.skipped_windows = 0                           # this run's windows replaced for a bad token (this rank)
        self._reported: set[tuple[int, int]] = set()      # (source, document) already named in a warning
        self.seq_len, self.seed, self.dp_rank, self.dp_size = int(seq_len), int(seed), int(dp_rank), int(dp_size)
        self.weights = [float(w) for w in weights]
        self.windows = [max(0, (s.num_tokens - 1) // self.seq_len) for s in self.sources]
        for name, n in zip(self.names, self.windows):
            if n == 0:
                raise ConfigError(f"{key}: source {name} holds fewer than data.seq_len+1={self.seq_len + 1} tokens")
        self._src, self._prefix, self._per_chunk = source_pattern(self.weights)
        for name, w, c in zip(self.names, self.weights, self._per_chunk):
            if c == 0:
                raise ConfigError(f"{key}: weight {w} of {name} is below 1/{CHUNK} of the total, so it would never be "
                                  "sampled; raise it or drop the source")
        self.consumed_samples = 0
        self.tokens_per_source = [0] * len(self.sources)   # this run's consumed tokens per source (all dp ranks)

    def samples(self, start: int, stop: int) -> list[Sample]:
        """Global samples ``[start, stop)`` of the blend, in order."""
        i = np.arange(start, stop, dtype=np.int64)
        chunk, slot = np.divmod(i, CHUNK)
        src = self._src[slot]
        k = chunk * self._per_chunk[src] + self._prefix[slot]     # position in its source's own stream
        out = np.empty(len(i), dtype=np.int64)
        for j in np.unique(src):
            sel = src == j
            epoch, pos = np.divmod(k[sel], self.windows[j])
            win = np.empty(len(pos), dtype=np.int64)
            for e in np.unique(epoch):
                at = epoch == e
                win[at] = feistel_permute(pos[at], self.windows[j], _key(self.seed, int(j), int(e)))
            out[sel] = win
        return [Sample(int(s), int(w)) for s, w in zip(src, out)]

    def read(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len
        rows = np.stack([self.sources[s.source].read(s.window * L, s.window * L + L + 1) for s in samples])
        if self.vocab_size is not None:
            bad = ((rows < 0) | (rows >= self.vocab_size)).any(axis=1)     # one vectorised comparison per batch
            for i in np.flatnonzero(bad):
                rows[i] = self._clean_window(samples[i], rows[i])
        rows = torch.from_numpy(rows.astype(np.int64, copy=False))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _clean_window(self, sample: Sample, row: np.ndarray) -> np.ndarray:
        """A window holding a token id outside the vocabulary: ``error`` raises ``BadDocument`` naming it;
        ``skip`` returns the next window of the same source without one (a function of the data alone, so every
        rank and every resume reads the same), with one warning per bad document."""
        L, j = self.seq_len, sample.source
        src, w = self.sources[j], sample.window
        for _ in range(self.windows[j]):
            at = first_bad(row, self.vocab_size)
            if at is None:
                return row
            where, doc = bad_token(self.key, self.names[j], src, w * L + at, int(row[at]), self.vocab_size)
            if self.on_bad_document != "skip":
                raise BadDocument(f"{where}; set data.on_bad_document=skip to skip the windows that hold it, or "
                                  "repair the data")
            if (j, doc) not in self._reported:
                self._reported.add((j, doc))
                log.warning("%s; skipped (data.on_bad_document=skip): each window holding it is replaced by the "
                            "next clean window of the source", where)
            self.skipped_windows += 1
            w = (w + 1) % self.windows[j]
            row = src.read(w * L, w * L + L + 1)
        raise BadDocument(f"{self.key}: source {self.names[j]} ({getattr(src, 'path', src)}) has no window without "
                          f"a token id outside model.vocab_size={self.vocab_size}")

    def next_batch(self, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch of ``global_batch_size`` sequences."""
        if global_batch_size % self.dp_size:
            raise ValueError(f"global batch {global_batch_size} is not divisible by dp_size {self.dp_size}")
        b = global_batch_size // self.dp_size
        everyone = self.samples(self.consumed_samples, self.consumed_samples + global_batch_size)
        for s in everyone:
            self.tokens_per_source[s.source] += self.seq_len
        self.consumed_samples += global_batch_size
        return self.read(everyone[self.dp_rank * b:(self.dp_rank + 1) * b])

    def source_metrics(self) -> dict:
        """Tokens consumed per source since start-up (keys ``tokens/<name>``, all ranks) and, when there were
        any, the windows this rank replaced for a bad token (``skipped_windows``)."""
        out = {f"tokens/{n}": t for n, t in zip(self.names, self.tokens_per_source)}
        if self.skipped_windows:
            out["skipped_windows"] = self.skipped_windows
        return out

    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.consumed_samples), "seed": self.seed, "kind": "blend",
                "sources": [{"name": n, "windows": int(w), "weight": float(x)}
                            for n, w, x in zip(self.names, self.windows, self.weights)]}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at ``consumed_samples``; a checkpoint written with another seed, other sources or other
        weights is refused with one line naming the key (its position would index other samples)."""
        fresh = "or start a new run with checkpoint.resume=none or another checkpoint.dir"
        if sd.get("kind") != "blend":
            raise ConfigError(f"{self.key}: the checkpoint was trained on a text corpus (data.path), this run reads "
                              f"token datasets; resume with the checkpoint's data settings, {fresh}")
        if int(sd["seed"]) != self.seed:
            raise ConfigError(f"train.seed: the checkpoint was written with train.seed={int(sd['seed'])}, this run has "
                              f"train.seed={self.seed} (the seed fixes the data order); resume with train.seed="
                              f"{int(sd['seed'])}, {fresh}")
        mine = self.state_dict()["sources"]
        if [(s["windows"], s["weight"]) for s in sd["sources"]] != [(s["windows"], s["weight"]) for s in mine]:
            saved = ", ".join(f"{s['name']} ({s['windows']} windows, weight {s['weight']})" for s in sd["sources"])
            now = ", ".join(f"{s['name']} ({s['windows']} windows, weight {s['weight']})" for s in mine)
            raise ConfigError(f"{self.key}: the checkpoint's blend was [{saved}], this run's is [{now}] (sources, their "
                              f"order, weights or data.seq_len changed); resume with the same blend, {fresh}")
        self.consumed_samples = int(sd["consumed_samples"])


class _Stream:
    """A token source seen as the 1-D array that ``data.batches``' window helpers index (``len``, slices)."""

    def __init__(self, src):
        self.src = src

    def __len__(self) -> int:
        return self.src.num_tokens

    def __getitem__(self, s: slice) -> np.ndarray:
        return self.src.read(s.start, s.stop)


def blend_val_batches(sources, names: list[str], seq_len: int, batch_size: int, max_batches: int,
                      vocab_size: int | None = None, on_bad_document: str = "error"
                      ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per validation source: ``data.val_batches`` of its stream (the first ``max_batches`` batches of
    consecutive windows). With ``vocab_size``, a window holding a token id outside it raises ``BadDocument``
    (``on_bad_document="error"``) or is left out of its batch (``"skip"``, one warning per window)."""
    out = {}
    for name, src in zip(names, sources):
        if (src.num_tokens - 1) // seq_len == 0:
            raise ConfigError(f"data.val_blend: source {name} holds fewer than data.seq_len+1={seq_len + 1} tokens")
        batches = val_batches(_Stream(src), seq_len, batch_size, max_batches)
        if vocab_size is not None:
            batches = _clean_val(batches, name, src, seq_len, batch_size, vocab_size, on_bad_document)
        out[name] = batches
    return out


def _clean_val(batches, name: str, src, seq_len: int, batch_size: int, vocab_size: int, on_bad: str):
    """``blend_val_batches``' check: batch k holds windows ``k*batch_size + i`` of the stream, in order."""
    kept = []
    for k, (x, y) in enumerate(batches):
        rows = torch.cat([x, y[:, -1:]], dim=1)
        bad_rows = ((rows < 0) | (rows >= vocab_size)).any(dim=1)
        for i in torch.nonzero(bad_rows).flatten().tolist():
            at = first_bad(rows[i].numpy(), vocab_size)
            where, _ = bad_token("data.val_blend", name, src, (k * batch_size + i) * seq_len + at, int(rows[i, at]),
                                 vocab_size)
            if on_bad != "skip":
                raise BadDocument(f"{where}; set data.on_bad_document=skip to leave its windows out, or repair the data")
            log.warning("%s; its window is left out of validation (data.on_bad_document=skip)", where)
        if bool(bad_rows.all()):
            continue
        kept.append((x[~bad_rows], y[~bad_rows]) if bool(bad_rows.any()) else (x, y))
    return kept
