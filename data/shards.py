"""Memory-mapped token shards: Megatron-LM's indexed-dataset layout, read and written here.

One shard is a ``<prefix>.bin`` / ``<prefix>.idx`` pair in the layout of Megatron-LM's ``MMapIndexedDataset``
(``megatron/core/datasets/indexed_dataset.py``), so Megatron reads our shards and we read its (docs/data.md):

    .bin   the tokens of every sequence back to back, a raw little-endian array of the index's dtype
    .idx   magic b"MMIDIDX\\x00\\x00" (9 bytes) | version <Q = 1 | dtype code <B | sequence_count S <Q |
           document_count D <Q | sequence_lengths int32[S] | sequence_pointers int64[S] (byte offsets into
           .bin) | document_indices int64[D] (first sequence of each document; first 0, last S, so D is the
           number of documents + 1) | Megatron's multimodal data may append sequence_modes int8[S] (ignored)

We write one sequence per document (each ending with the tokenizer's EOS id, like Megatron's ``--append-eod``),
dtype uint16 when the vocabulary fits (<= 65536 ids), int32 otherwise. A dataset directory written by
``python -m tools.prepare_data`` adds ``manifest.json`` (shard list, counts, sha256 of every file, tokenizer).

``open_tokens(path)`` gives a ``TokenSource``: the concatenation of a dataset's shards as one token stream
(``read(start, stop)``) and as documents (``document(i)``). Opening costs O(shards): the header of each
``.idx`` plus its last length and pointer (the shard's token count; the manifest's counts are checked
against them) and a ``stat`` of each ``.bin``; the arrays are memory-mapped on first use, at most
``_OPEN_SHARDS`` shards at a time (an mmap holds a file descriptor). Nothing hashes or scans the corpus
but ``verify(path)``.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Iterable

import numpy as np

from errors import ConfigError
from .corpus import atomic_write

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<QBQQ")                  # version, dtype code, sequence_count, document_count
HEADER_BYTES = len(MAGIC) + _HEADER.size           # 34
# Megatron's DType codes; 6 (float64) and 7 (float32) are not token dtypes.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
MANIFEST = "manifest.json"
FORMAT, FORMAT_VERSION = "dsv3-tokens", 1
_OPEN_SHARDS = 64
_CHUNK = 1 << 22                                   # tokens per write / hash step


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else int32 (Megatron has no uint32 code; int32 holds 2^31 ids)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ writer
def write_shard(prefix, documents: Iterable[np.ndarray], dtype) -> dict:
    """Write ``documents`` (1-D integer arrays, one sequence each) as ``<prefix>.bin`` + ``<prefix>.idx``.

    Each file goes to a temp name and is renamed into place, the ``.idx`` last, so a reader that finds the
    ``.idx`` finds the whole ``.bin``. Returns ``{tokens, docs, bin_bytes, idx_bytes, bin_sha256, idx_sha256}``.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    code = {np.dtype(t): c for c, t in DTYPE_CODES.items()}.get(np.dtype(dtype.type))
    if code is None:
        known = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise ValueError(f"write_shard: {dtype} is not a token dtype ({known})")
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    lengths, bin_hash = [], hashlib.sha256()

    def write_bin(f):
        pending, n = [], 0
        for doc in documents:
            doc = np.asarray(doc)
            if doc.size and (doc.min() < lo or doc.max() > hi):
                bad = doc.max() if doc.max() > hi else doc.min()
                raise ValueError(f"{prefix}.bin: token id {bad} does not fit {dtype.name}")
            if doc.size >= 1 << 31:
                raise ValueError(f"{prefix}.bin: a document of {doc.size} tokens exceeds int32 sequence lengths")
            pending.append(doc.astype(dtype, copy=False))
            lengths.append(doc.size)
            n += doc.size
            if n >= _CHUNK:
                pending, n = flush(f, pending), 0
        flush(f, pending)

    def flush(f, pending):
        if pending:
            block = np.concatenate(pending).tobytes()
            bin_hash.update(block)
            f.write(block)
        return []

    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    atomic_write(bin_path, write_bin)
    lengths = np.asarray(lengths, dtype=np.int64)
    pointers = (np.cumsum(lengths) - lengths) * dtype.itemsize
    index = b"".join([MAGIC, _HEADER.pack(1, code, lengths.size, lengths.size + 1), lengths.astype("<i4").tobytes(),
                      pointers.astype("<i8").tobytes(), np.arange(lengths.size + 1, dtype="<i8").tobytes()])
    atomic_write(idx_path, lambda f: f.write(index))
    n_tokens = int(lengths.sum())
    return {"tokens": n_tokens, "docs": int(lengths.size), "bin_bytes": n_tokens * dtype.itemsize,
            "idx_bytes": len(index), "bin_sha256": bin_hash.hexdigest(),
            "idx_sha256": hashlib.sha256(index).hexdigest()}


# ------------------------------------------------------------------------------------------------ reader
class _Shard:
    """One ``.bin``/``.idx`` pair: the header is read and checked at construction, the arrays mapped later."""

    def __init__(self, prefix: str):
        self.prefix, self.bin_path, self.idx_path = prefix, f"{prefix}.bin", f"{prefix}.idx"
        if not os.path.isfile(self.idx_path):
            raise ConfigError(f"{self.idx_path}: missing (a shard is a .bin/.idx pair)")
        if not os.path.isfile(self.bin_path):
            raise ConfigError(f"{self.bin_path}: missing (its index {os.path.basename(self.idx_path)} is there)")
        idx_bytes = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
                raise ConfigError(f"{self.idx_path}: not a Megatron indexed-dataset index (bad magic {head[:9]!r}, "
                                  f"expected {MAGIC!r})")
            version, code, self.n_seqs, self.n_doc_idx = _HEADER.unpack(head[len(MAGIC):])
            S, n_doc_idx = self.n_seqs, self.n_doc_idx
            if version != 1:
                raise ConfigError(f"{self.idx_path}: index version {version}, this reader knows version 1")
            if code not in DTYPE_CODES:
                raise ConfigError(f"{self.idx_path}: unknown token dtype code {code} (known: "
                                  + ", ".join(f"{c} {np.dtype(t).name}" for c, t in DTYPE_CODES.items()) + ")")
            self.dtype = np.dtype(DTYPE_CODES[code])
            self.num_docs = max(0, n_doc_idx - 1)
            arrays = HEADER_BYTES + 12 * S + 8 * n_doc_idx
            if idx_bytes not in (arrays, arrays + S):      # + S: Megatron's multimodal sequence_modes
                raise ConfigError(f"{self.idx_path}: {idx_bytes} bytes, its header ({S} sequences, {n_doc_idx} "
                                  f"document indices) needs {arrays} (truncated or not this layout)")
            self.num_tokens = 0
            if S:    # the shard's size from its last sequence: pointer + length (pointers are contiguous)
                f.seek(HEADER_BYTES + 4 * (S - 1))
                last_len = int(np.frombuffer(f.read(4), "<i4")[0])
                f.seek(HEADER_BYTES + 4 * S + 8 * (S - 1))
                last_ptr = int(np.frombuffer(f.read(8), "<i8")[0])
                self.num_tokens = last_ptr // self.dtype.itemsize + last_len
        bin_bytes = os.path.getsize(self.bin_path)
        if bin_bytes != self.num_tokens * self.dtype.itemsize:
            raise ConfigError(f"{self.bin_path}: {bin_bytes} bytes, its index says {self.num_tokens} "
                              f"{self.dtype.name} tokens = {self.num_tokens * self.dtype.itemsize} bytes "
                              "(truncated, or another shard's .bin)")

    def open(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> (tokens, sequence_lengths, sequence_pointers, document_indices), memory-mapped."""
        tokens = (np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"), mode="r") if self.num_tokens
                  else np.zeros(0, self.dtype))
        index, S = np.memmap(self.idx_path, dtype=np.uint8, mode="r"), self.n_seqs
        lengths = np.frombuffer(index, dtype="<i4", count=S, offset=HEADER_BYTES)
        pointers = np.frombuffer(index, dtype="<i8", count=S, offset=HEADER_BYTES + 4 * S)
        doc_idx = np.frombuffer(index, dtype="<i8", count=self.n_doc_idx, offset=HEADER_BYTES + 12 * S)
        return tokens, lengths, pointers, doc_idx


class TokenSource:
    """Read-only view of one dataset: the concatenation of its shards, in order (see the module docstring)."""

    def __init__(self, path: str, shards: list[_Shard], manifest: dict | None, manifest_bytes: bytes | None):
        self.path = str(path)
        self._shards = shards
        tok = (manifest or {}).get("tokenizer", {})
        self.vocab_size: int | None = tok.get("vocab_size")
        self.eos_id: int | None = tok.get("eos_id")
        self.tokenizer_hash: str | None = tok.get("sha256")
        dtypes = {s.dtype for s in shards}
        if len(dtypes) > 1:
            raise ConfigError(f"{path}: shards of several token dtypes ({', '.join(sorted(d.name for d in dtypes))}); "
                              "one dataset has one tokenizer, so one dtype")
        self.dtype = np.dtype(dtypes.pop() if dtypes else np.uint16)
        self._tok_offsets = np.cumsum([0] + [s.num_tokens for s in shards], dtype=np.int64)
        self._doc_offsets = np.cumsum([0] + [s.num_docs for s in shards], dtype=np.int64)
        self.num_tokens, self.num_docs = int(self._tok_offsets[-1]), int(self._doc_offsets[-1])
        if manifest_bytes is not None:
            self._fingerprint = "manifest-" + hashlib.sha256(manifest_bytes).hexdigest()[:24]
        else:
            stats = [(os.path.basename(p), os.stat(p).st_size, os.stat(p).st_mtime_ns)
                     for s in shards for p in (s.idx_path, s.bin_path)]
            self._fingerprint = "files-" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:24]
        self._maps: OrderedDict[int, tuple] = OrderedDict()

    def __repr__(self) -> str:
        return (f"TokenSource({self.path!r}, {len(self._shards)} shards, {self.num_docs} docs, "
                f"{self.num_tokens} tokens, {self.dtype.name})")

    def __getstate__(self) -> dict:   # pickled (e.g. to DataLoader workers) without the mapped arrays
        return {**self.__dict__, "_maps": OrderedDict()}

    @property
    def shard_prefixes(self) -> list[str]:
        return [s.prefix for s in self._shards]

    def fingerprint(self) -> str:
        """Identity without reading data: the manifest's sha256, or the shards' names, sizes and mtimes."""
        return self._fingerprint

    def _open(self, k: int) -> tuple:
        if k in self._maps:
            self._maps.move_to_end(k)
        else:
            self._maps[k] = self._shards[k].open()
            if len(self._maps) > _OPEN_SHARDS:   # the evicted maps close when their last view goes
                self._maps.popitem(last=False)
        return self._maps[k]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated stream (across shard boundaries), an int64 copy."""
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.path}: read({start}, {stop}) outside [0, {self.num_tokens}]")
        out = np.empty(stop - start, dtype=np.int64)
        k, pos = int(np.searchsorted(self._tok_offsets, start, side="right")) - 1, start
        while pos < stop:
            base = int(self._tok_offsets[k])
            end = min(stop, int(self._tok_offsets[k + 1]))
            if end > pos:
                out[pos - start:end - start] = self._open(k)[0][pos - base:end - base]
            pos, k = end, k + 1
        return out

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (all its sequences; with our shards, its text's tokens and EOS), int64."""
        i = int(i)
        if not 0 <= i < self.num_docs:
            raise IndexError(f"{self.path}: document {i} outside [0, {self.num_docs})")
        k = int(np.searchsorted(self._doc_offsets, i, side="right")) - 1
        _, _, pointers, doc_idx = self._open(k)
        j, size = i - int(self._doc_offsets[k]), self.dtype.itemsize
        first, last = int(doc_idx[j]), int(doc_idx[j + 1])
        start = int(pointers[first]) // size if first < len(pointers) else self._shards[k].num_tokens
        stop = int(pointers[last]) // size if last < len(pointers) else self._shards[k].num_tokens
        return np.asarray(self._open(k)[0][start:stop], dtype=np.int64)

    def locate(self, pos: int) -> tuple[str, int, int]:
        """Where token ``pos`` of the concatenated stream lives: ``(shard .bin path, document index in this
        dataset, position inside that document)``."""
        pos = int(pos)
        if not 0 <= pos < self.num_tokens:
            raise IndexError(f"{self.path}: token {pos} outside [0, {self.num_tokens})")
        k = int(np.searchsorted(self._tok_offsets, pos, side="right")) - 1
        _, _, pointers, doc_idx = self._open(k)
        local, size = pos - int(self._tok_offsets[k]), self.dtype.itemsize
        seq = int(np.searchsorted(np.asarray(pointers) // size, local, side="right")) - 1
        doc = max(0, int(np.searchsorted(np.asarray(doc_idx), seq, side="right")) - 1)
        first = int(doc_idx[doc]) if doc < len(doc_idx) else 0
        start = int(pointers[first]) // size if first < len(pointers) else 0
        return self._shards[k].bin_path, int(self._doc_offsets[k]) + doc, local - start


def _prefix_of(p: Path) -> str | None:
    s = str(p)
    if s.endswith((".bin", ".idx")) and p.is_file():
        return s[:-4]
    if Path(s + ".idx").exists() or Path(s + ".bin").exists():
        return s
    return None


def is_token_dataset(path) -> bool:
    """Whether ``open_tokens`` would read ``path`` as a token dataset: a directory with our ``manifest.json`` or
    Megatron ``.idx`` files, a Megatron prefix, or one of its ``.bin``/``.idx`` files (a look at names only)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        if (p / MANIFEST).is_file():
            try:
                return json.loads((p / MANIFEST).read_bytes()).get("format") == FORMAT
            except (OSError, ValueError, AttributeError):
                return False
        return any(p.glob("*.idx"))
    return _prefix_of(p) is not None


def _read_manifest(d: Path) -> tuple[dict, bytes]:
    raw = (d / MANIFEST).read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{d / MANIFEST}: not JSON ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{d / MANIFEST}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                          f"this reader knows {FORMAT!r} version {FORMAT_VERSION}")
    missing = [k for k in ("dtype", "shards", "tokenizer") if k not in manifest]
    missing += sorted({k for e in manifest.get("shards", []) for k in ("name", "tokens", "docs") if k not in e})
    if missing:
        raise ConfigError(f"{d / MANIFEST}: missing keys {missing}")
    return manifest, raw


def open_tokens(path) -> TokenSource:
    """Open a dataset: a directory with ``manifest.json`` (ours), a Megatron prefix ``foo`` (``foo.bin`` +
    ``foo.idx``) or either file's path, or a directory of Megatron pairs (every ``*.idx``, sorted by name)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir() and (p / MANIFEST).is_file():
        manifest, raw = _read_manifest(p)
        shards = []
        for entry in manifest["shards"]:
            name = entry["name"]
            missing = [f"{name}{s}" for s in (".bin", ".idx") if not (p / f"{name}{s}").is_file()]
            if missing:
                raise ConfigError(f"{p / MANIFEST}: lists shard {name}; missing in {p}: {', '.join(missing)}")
            shard = _Shard(str(p / name))
            if (shard.num_tokens, shard.num_docs) != (entry["tokens"], entry["docs"]):
                raise ConfigError(f"{shard.idx_path}: {shard.num_tokens} tokens in {shard.num_docs} documents, "
                                  f"{MANIFEST} says {entry['tokens']} in {entry['docs']} (replaced after prepare_data?)")
            if shard.dtype.name != manifest["dtype"]:
                raise ConfigError(f"{shard.idx_path}: dtype {shard.dtype.name}, {MANIFEST} says {manifest['dtype']}")
            shards.append(shard)
        return TokenSource(str(path), shards, manifest, raw)
    if p.is_dir():
        prefixes = sorted(str(f)[:-4] for f in p.glob("*.idx"))
        if not prefixes:
            raise ConfigError(f"{path}: directory holds neither {MANIFEST} nor Megatron .bin/.idx pairs")
        return TokenSource(str(path), [_Shard(x) for x in prefixes], None, None)
    prefix = _prefix_of(p)
    if prefix is None:
        raise ConfigError(f"{path}: not found (expected a directory with {MANIFEST}, a Megatron prefix with "
                          f"PREFIX.bin and PREFIX.idx, or a directory of such pairs)")
    return TokenSource(str(path), [_Shard(prefix)], None, None)


def verify(path) -> list[str]:
    """Full check of a dataset (reads everything): the manifest's sha256 of every file, each index's internal
    consistency (pointers follow the lengths, document indices run from 0 to the sequence count) and token
    ids below the manifest's vocab_size. Returns the problems found, one line each; [] when good."""
    try:
        src = open_tokens(path)
    except (ConfigError, OSError) as e:
        return [str(e)]
    problems = []
    p = Path(os.path.expanduser(str(path)))
    manifest = _read_manifest(p)[0] if p.is_dir() and (p / MANIFEST).is_file() else None
    entries = {e["name"]: e for e in manifest["shards"]} if manifest else {}
    for k, shard in enumerate(src._shards):
        tokens, lengths, pointers, doc_idx = shard.open()
        expect = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * shard.dtype.itemsize
        if shard.n_seqs and not np.array_equal(pointers, expect):
            problems.append(f"{shard.idx_path}: sequence pointers do not follow the sequence lengths")
        if len(doc_idx) and (doc_idx[0] != 0 or doc_idx[-1] != shard.n_seqs or np.any(np.diff(doc_idx) < 0)):
            problems.append(f"{shard.idx_path}: document indices do not run from 0 to {shard.n_seqs}")
        if src.vocab_size is not None:
            for a in range(0, shard.num_tokens, _CHUNK):
                top = int(tokens[a:a + _CHUNK].max())
                if top >= src.vocab_size:
                    problems.append(f"{shard.bin_path}: token id {top} >= vocab_size {src.vocab_size}")
                    break
        entry = entries.get(os.path.basename(shard.prefix))
        for kind, f in (("bin", shard.bin_path), ("idx", shard.idx_path)):
            if entry and sha256_file(f) != entry[f"{kind}_sha256"]:
                problems.append(f"{f}: sha256 differs from {MANIFEST}'s (file changed or damaged)")
        del tokens, lengths, pointers, doc_idx
    return problems
