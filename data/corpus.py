"""A training corpus: load it and tokenize it once (cached).

``load_corpus`` turns ``data_cfg`` (path / tokenizer / text_field / val_fraction / cache_dir) into two flat
int32 token streams (documents joined by EOS). Everything runs offline: with ``data.path`` unset the corpus is
the English help text that ships with CPython (``pydoc_data.topics``), and with ``data.tokenizer`` unset a
byte-level BPE is trained on the training documents (``data.tokenizer``). Tokenizer and token arrays are
cached in ``data.cache_dir`` under a key that hashes the inputs (file stats / content, tokenizer bytes, vocab
size, split settings), so a second call only reads two ``.npy`` files. ``datasets`` and the Hugging Face Hub
stay offline unless ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` say otherwise (``use_offline_hub``).

The batches served from those streams: ``data/batches.py``.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from errors import ConfigError, disk_error, write_error, writing

from .tokenizer import encode, find_eos_id, load_tokenizer, train_bpe, wrap_tokenizer

FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_CACHE_VERSION = "data-v1"
_BATCH_DOCS = 1024
_LISTED = 10          # unsupported files named in the warning / error; the rest are counted
log = logging.getLogger(__name__)
CACHE_FIX = ("Free space there or set data.cache_dir to a disk with room (the cache is rebuilt from the data); "
             "nothing was trained")


def cache_writing(path: Path, what: str):
    """``errors.writing`` for a file in ``data.cache_dir``: an OSError inside is one line, exit 2."""
    return writing("data.cache_dir", path, what, CACHE_FIX)


@dataclass
class Corpus:
    train_tokens: np.ndarray   # 1-D int32, documents concatenated, each followed by eos_id
    val_tokens: np.ndarray
    eos_id: int
    vocab_size: int            # len(tokenizer)
    tokenizer: "transformers.PreTrainedTokenizerFast"  # noqa: F821
    tokenizer_source: str = ""  # data.tokenizer, or the cached BPE file trained on this corpus
    cache_hit: bool = False     # the token arrays came from data.cache_dir (nothing tokenized in this run)
    cache_file: str = ""

    def summary(self, source: str) -> str:
        """One start-up line: documents, tokens, tokenizer, cache."""
        docs = [int(np.count_nonzero(np.asarray(a) == self.eos_id)) for a in (self.train_tokens, self.val_tokens)]
        return (f"data: {source}: {docs[0]:,} + {docs[1]:,} documents, {len(self.train_tokens):,} training + "
                f"{len(self.val_tokens):,} validation tokens; tokenizer {self.tokenizer_source} (vocab {self.vocab_size}, "
                f"eos id {self.eos_id}); {'cache hit' if self.cache_hit else 'tokenized now, cached'}: {self.cache_file}")


# ----------------------------------------------------------------------------------------------- helpers
def _sha(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def atomic_write(path: Path, write) -> None:
    """``write(fileobj)`` into a temp file next to ``path``, then rename over it (readers never see halves)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _is_main_process() -> bool:
    """Global rank 0 (or no process group): data warnings are printed once per run, not once per rank."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0


def _listing(paths: list[str], root: Path | None = None) -> str:
    names = [os.path.relpath(f, root) if root is not None else f for f in paths]
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def files_fingerprint(files) -> list:
    return [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def resolve_source(path):
    """-> (kind, files, fingerprint). kind: 'default' | 'saved' (save_to_disk dir) | 'files'."""
    if path is None:
        from pydoc_data.topics import topics
        return "default", [], ["pydoc_data", hashlib.sha256("\0".join(topics[k] for k in sorted(topics)).encode()).hexdigest()]
    hint = "(point data.path at a .txt/.jsonl/.parquet file, a directory of them, or a saved HF dataset)"
    from .shards import is_token_dataset   # here: data.shards imports this module
    if is_token_dataset(path):
        raise ConfigError(f"data.path: {path} is a token dataset (tools.prepare_data output or Megatron .bin/.idx), "
                          f"already tokenized, and data.path reads text: train on it with data.blend='[{{path: "
                          f"{path}}}]' instead of data.path")
    p = Path(os.path.expanduser(str(path)))
    if any(c in str(path) for c in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(str(path)), recursive=True) if os.path.isfile(f))
        if not files:
            raise ConfigError(f"data.path: glob {path} matches no files {hint}")
    elif not p.exists():
        raise ConfigError(f"data.path: {path} does not exist {hint}")
    elif p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        files = sorted(str(f) for f in p.rglob("*") if f.is_file())
        return "saved", [str(p)], files_fingerprint(files)
    elif p.is_dir():
        found = sorted(str(f) for f in p.rglob("*") if f.is_file())
        files = [f for f in found if Path(f).suffix.lower() in FILE_BUILDERS]
        skipped = [f for f in found if Path(f).suffix.lower() not in FILE_BUILDERS]
        if not files:
            raise ConfigError(f"data.path: directory {path} holds no .txt/.jsonl/.json/.parquet files {hint}"
                              + (f"; it has {_listing(skipped, p)}" if skipped else ""))
        if skipped and _is_main_process():
            # A warning, not an error: dataset directories usually carry README.md, LICENSE, .gitattributes
            # or download metadata; a glob (data.path='<dir>/**/*.jsonl') picks the files explicitly.
            log.warning(f"data.path: skipping {len(skipped)} file(s) in {path} that are not .txt/.jsonl/.json/"
                        f".parquet: {_listing(skipped, p)} (name the data files with a glob to silence this)")
    else:
        files = [str(p)]
    bad = [f for f in files if Path(f).suffix.lower() not in FILE_BUILDERS]
    if bad:
        raise ConfigError(f"data.path: unsupported file type (expected .txt/.jsonl/.json/.parquet): {_listing(bad)}")
    return "files", files, files_fingerprint(files)


class _TextColumn:
    """A list of documents served like a one-column ``datasets.Dataset`` (``len``, ``ds[a:b]["text"]``): the
    default corpus needs no ``datasets`` install (e.g. a GPU machine with only torch and tokenizers)."""

    column_names = ["text"]

    def __init__(self, texts: list[str]):
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, rows: slice) -> dict:
        return {"text": self.texts[rows]}


def load_sources(kind, files, text_field, cache_dir: Path):
    """-> list of single-column datasets.Dataset. Plain text is split into documents at blank lines."""
    if kind == "default":
        from pydoc_data.topics import topics
        return [_TextColumn([topics[k] for k in sorted(topics)])]
    import datasets
    out = []
    if kind == "saved":
        ds = datasets.load_from_disk(files[0])
        out = [(ds[k], text_field) for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [(ds, text_field)]
    for ext in sorted({Path(f).suffix.lower() for f in files}) if kind == "files" else []:
        builder = FILE_BUILDERS[ext]    # empty files are skipped: they have no schema to infer
        group = [f for f in files if Path(f).suffix.lower() == ext and os.path.getsize(f) > 0]
        kw = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            if group:
                out.append((datasets.load_dataset(builder, data_files=group, split="train",
                                                  cache_dir=str(cache_dir / "hf_datasets"), **kw),
                            "text" if builder == "text" else text_field))
        except Exception as e:  # noqa: BLE001 - malformed json/parquet: report against data.path
            if disk_error(e) is not None:   # datasets writes its Arrow cache under data.cache_dir
                raise write_error("data.cache_dir", cache_dir / "hf_datasets", "the datasets cache of data.path",
                                  CACHE_FIX, disk_error(e)) from e
            c = e.__cause__ or e
            raise ConfigError(f"data.path: cannot read {group[0]}{' ...' if len(group) > 1 else ''} as {builder}: "
                              f"{type(c).__name__}: {(str(c).splitlines() or [''])[0]}") from e
    for ds, col in out:
        if col not in ds.column_names:
            raise ConfigError(f"data.text_field: column {col!r} not in dataset columns {ds.column_names}")
        if getattr(ds.features[col], "dtype", None) not in ("string", "large_string"):
            raise ConfigError(f"data.text_field: column {col!r} holds {ds.features[col]}, not text")
    return [ds.select_columns([col]).rename_column(col, "text") if col != "text" else ds.select_columns(["text"])
            for ds, col in out]


def iter_docs(sources):
    """Yield batches (lists) of non-empty documents, in a fixed order."""
    for ds in sources:
        for start in range(0, len(ds), _BATCH_DOCS):
            batch = [t for t in ds[start:start + _BATCH_DOCS]["text"] if t and not t.isspace()]
            if batch:
                yield batch


def _is_val_mask(n_docs: int, val_fraction: float) -> np.ndarray:
    """Validation documents: ``val_fraction`` of them (at least one, leaving one for training); none for 0."""
    n_val = 0 if val_fraction == 0 else min(n_docs - 1, max(1, int(round(n_docs * val_fraction))))
    mask = np.zeros(n_docs, dtype=bool)
    mask[np.random.default_rng(0).permutation(n_docs)[:n_val]] = True
    return mask


def _train_docs(sources, is_val: np.ndarray):
    """Batches of the training documents (``is_val`` marks the validation ones)."""
    i = 0
    for batch in iter_docs(sources):
        keep = ~is_val[i:i + len(batch)]
        i += len(batch)
        yield [d for d, k in zip(batch, keep) if k]


def _load_docs(data_cfg, kind, files, text_field: str, val_fraction: float, cache_dir: Path):
    """-> (sources, validation mask over their documents); at least one document per split asked for."""
    sources = load_sources(kind, files, text_field, cache_dir)
    n_docs = sum(len(b) for b in iter_docs(sources))
    need = 1 if val_fraction == 0 else 2
    if n_docs < need:
        raise ConfigError(f"data.path: {data_cfg.path or 'default corpus'} holds {n_docs} non-empty "
                          f"document(s); need at least {need} ({'one' if need == 1 else 'one train, one validation'}"
                          "; .txt documents are split at blank lines)")
    return sources, _is_val_mask(n_docs, val_fraction)


def _tokenizer(tok_name, vocab_size: int, cache_dir: Path, corpus_key: str, docs):
    """-> (tokenizer, identity hash, description): ``data.tokenizer``, or a byte-level BPE trained on the
    training documents (``docs()``) and cached."""
    if tok_name is None:
        if vocab_size < 257:
            raise ConfigError(f"model.vocab_size: {vocab_size} is too small for a byte-level BPE (needs >= 257)")
        tok_file = cache_dir / f"tokenizer-{_sha(corpus_key, vocab_size, 'bytelevel-bpe')}.json"
        if not tok_file.exists():
            text = train_bpe(_train_docs(*docs()), vocab_size)
            with cache_writing(tok_file, "the byte-level BPE trained on the corpus"):
                atomic_write(tok_file, lambda f: f.write(text.encode()))
        tokenizer, tok_id = wrap_tokenizer(str(tok_file)), hashlib.sha256(tok_file.read_bytes()).hexdigest()
        return tokenizer, tok_id, f"byte-level BPE trained on this corpus ({tok_file})"
    return *load_tokenizer(str(tok_name)), str(tok_name)


def _tokenize(tokenizer, eos_id: int, sources, is_val) -> dict[str, np.ndarray]:
    """Token stream per split: each document's ids followed by ``eos_id``."""
    parts, i = {"train": [], "val": []}, 0
    for batch in iter_docs(sources):
        for ids, v in zip(encode(tokenizer, batch), is_val[i:i + len(batch)]):
            parts["val" if v else "train"].append(np.asarray(list(ids) + [eos_id], dtype=np.int32))
        i += len(batch)
    return {s: np.concatenate(parts[s]) if parts[s] else np.zeros(0, np.int32) for s in parts}


def use_offline_hub() -> None:
    """``datasets`` and the Hugging Face Hub offline (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` = 1) unless the
    environment sets them. Both libraries read them when first imported: call this before (``load_corpus`` does)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


# -------------------------------------------------------------------------------------------- public API
def load_corpus(data_cfg, vocab_size: int) -> Corpus:
    """Load, split (by document), tokenize and cache ``data_cfg``'s corpus; see the module docstring."""
    use_offline_hub()
    text_field = getattr(data_cfg, "text_field", "text") or "text"
    val_fraction = float(getattr(data_cfg, "val_fraction", 0.05))
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: {val_fraction} must be in [0, 1)")
    cache_dir = Path(os.path.expanduser(str(getattr(data_cfg, "cache_dir", None) or ".cache/data")))
    with cache_writing(cache_dir, "the directory of the tokenized corpus"):
        cache_dir.mkdir(parents=True, exist_ok=True)
    kind, files, fingerprint = resolve_source(getattr(data_cfg, "path", None))
    corpus_key = _sha(_CACHE_VERSION, kind, fingerprint, text_field if kind != "default" else None, val_fraction)
    docs = cache(lambda: _load_docs(data_cfg, kind, files, text_field, val_fraction, cache_dir))   # read if needed

    tok_name = getattr(data_cfg, "tokenizer", None)
    tokenizer, tok_id, tok_source = _tokenizer(tok_name, vocab_size, cache_dir, corpus_key, docs)
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"data.tokenizer: tokenizer vocab ({len(tokenizer)}) exceeds model.vocab_size "
                          f"({vocab_size}); raise model.vocab_size")
    eos_id = find_eos_id(tokenizer, tok_name or "trained BPE")

    key = _sha(corpus_key, tok_id, vocab_size, eos_id)
    paths = {s: cache_dir / f"tokens-{key}.{s}.npy" for s in ("train", "val")}
    meta = cache_dir / f"tokens-{key}.json"
    cache_hit = meta.exists() and all(p.exists() for p in paths.values())
    if not cache_hit:
        arrays = _tokenize(tokenizer, eos_id, *docs())
        for split, p in paths.items():
            with cache_writing(p, f"the tokenized corpus ({split} split, {len(arrays[split]):,} tokens)"):
                atomic_write(p, lambda f, a=arrays[split]: np.save(f, a))
        info = {"train_tokens": len(arrays["train"]), "val_tokens": len(arrays["val"]), "eos_id": eos_id,
                "vocab_size": len(tokenizer), "source": str(getattr(data_cfg, "path", None))}
        with cache_writing(meta, "the tokenized corpus's index"):   # written last: the cache hit needs it
            atomic_write(meta, lambda f: f.write(json.dumps(info).encode()))
    train, val = (np.load(paths[s], mmap_mode="r") for s in ("train", "val"))
    seq_len = getattr(data_cfg, "seq_len", None)
    if val_fraction > 0 and seq_len and len(val) < seq_len + 1:
        # Validation was asked for but would measure nothing (the trainer would log val_loss 0.0).
        raise ConfigError(f"data.val_fraction: {val_fraction} holds out {len(val)} validation tokens, fewer than one "
                          f"window of data.seq_len+1={seq_len + 1}; raise data.val_fraction or lower data.seq_len, "
                          "or set data.val_fraction=0 to train without validation")
    return Corpus(train_tokens=train, val_tokens=val, eos_id=eos_id, vocab_size=len(tokenizer), tokenizer=tokenizer,
                  tokenizer_source=tok_source, cache_hit=cache_hit, cache_file=str(paths["train"]))
