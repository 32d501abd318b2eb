"""Tokenize text corpora into memory-mapped token shards (Megatron-LM indexed-dataset layout + manifest.json).

    python -m tools.prepare_data --input 'data/web/*.jsonl.gz' data/books --output /data/tok/web \\
        --tokenizer /models/tok --workers 8

Inputs are read the way the trainer reads ``data.path`` (``data/corpus.py``): .txt (documents split at blank
lines), .jsonl/.json and .parquet (``--text-field``), directories of them, globs, ``save_to_disk`` datasets;
gzip-compressed files (``x.jsonl.gz``, ``x.json.gz``, ``x.txt.gz``) are read here when named by a file path or
a glob. The input rows, in that fixed order, are cut into shards of ``--docs-per-shard`` rows: shard k holds
rows ``[k*D, (k+1)*D)`` (empty documents dropped), so the output does not depend on ``--workers``. Each
document becomes its tokens + EOS. Worker processes (fork) tokenize whole shards and write
``shard-00000.bin/.idx``; a finished shard is recorded in ``shard-00000.done.json`` (counts, sizes, sha256).
A re-run with the same inputs, tokenizer and settings keeps the recorded shards whose files have the recorded
sizes and redoes the rest, so a killed run continues and ends byte-identical to an uninterrupted one.
``manifest.json`` is written last; the tokenizer is copied into ``OUTPUT/tokenizer/``. docs/data.md has the
format. Errors print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import glob
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from errors import ConfigError
from data.corpus import (FILE_BUILDERS, atomic_write, files_fingerprint, iter_docs, load_sources, resolve_source,
                          use_offline_hub)
from data.tokenizer import TOKENIZER_FILES, encode, find_eos_id, load_tokenizer
from data.shards import FORMAT, FORMAT_VERSION, MANIFEST, open_tokens, token_dtype, write_shard

_COMPRESSED = {f"{ext}.gz": ext for ext in (".jsonl", ".json", ".txt")}
_KEYS = {"data.path": "--input", "data.tokenizer": "--tokenizer", "data.text_field": "--text-field"}
KILL_AFTER_ENV = "DSV3_PREPARE_DATA_KILL_AFTER"   # test hook: SIGKILL this process after N shards of a run


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def _compressed_ext(f) -> str | None:
    name = str(f).lower()
    return next((inner for ext, inner in _COMPRESSED.items() if name.endswith(ext)), None)


# --------------------------------------------------------------------------------------------------- inputs
def _resolve_input(arg: str):
    """-> (kind, files, fingerprint) for one --input: data.corpus's resolution, or ('gz', files, ...) for a file
    or glob of gzip-compressed files (data.corpus does not read those)."""
    p = Path(os.path.expanduser(arg))
    if any(c in arg for c in "*?["):
        matched = sorted(f for f in glob.glob(os.path.expanduser(arg), recursive=True) if os.path.isfile(f))
    elif p.is_dir() and not (p / "state.json").exists() and not (p / "dataset_dict.json").exists():
        matched = sorted(str(f) for f in p.rglob("*") if f.is_file())
    else:
        matched = [str(p)] if p.is_file() else []
    gz = [f for f in matched if _compressed_ext(f)]
    if not gz:
        return resolve_source(arg)
    if p.is_dir() or len(gz) < len(matched):
        example = os.path.join(arg.rstrip("*/"), "**/*.jsonl.gz")
        raise ConfigError(f"--input: {arg} mixes gzip-compressed files ({gz[0]}, ...) with others; name the "
                          f"compressed ones with their own glob (e.g. --input '{example}')")
    return "gz", gz, files_fingerprint(gz)


def _load_compressed(files, text_field, cache_dir: Path):
    """One single-column ``datasets.Dataset`` per inner extension (sorted), like ``data.corpus.load_sources``."""
    import datasets
    out = []
    for inner in sorted({_compressed_ext(f) for f in files}):
        group = [f for f in files if _compressed_ext(f) == inner]
        builder = FILE_BUILDERS[inner]
        col = "text" if builder == "text" else text_field
        ds = datasets.load_dataset(builder, data_files=group, split="train", cache_dir=str(cache_dir / "hf_datasets"),
                                   **({"sample_by": "paragraph"} if builder == "text" else {}))
        if col not in ds.column_names:
            raise ConfigError(f"--text-field: column {col!r} not in {group[0]}'s columns {ds.column_names}")
        ds = ds.select_columns([col])
        out.append(ds.rename_column(col, "text") if col != "text" else ds)
    return out


def _load_inputs(resolved, text_field, cache_dir: Path) -> list:
    sources = []
    for kind, files, _ in resolved:
        sources += (_load_compressed(files, text_field, cache_dir) if kind == "gz"
                    else load_sources(kind, files, text_field, cache_dir))
    return sources


def _rows(sources, a: int, b: int) -> list:
    """Rows ``[a, b)`` of the concatenated sources, as contiguous selections (no index mapping)."""
    out, base = [], 0
    for ds in sources:
        lo, hi = max(a - base, 0), min(b - base, len(ds))
        if lo < hi:
            out.append(ds.select(range(lo, hi)))
        base += len(ds)
    return out


# ------------------------------------------------------------------------------------------------ tokenizer
def _tokenizer_files(path: str, tok) -> dict[str, bytes]:
    """The files copied to OUTPUT/tokenizer/; always holds tokenizer.json, whose sha256 names the tokenizer."""
    p = Path(os.path.expanduser(path))
    files = {f.name: f.read_bytes() for f in sorted(p.iterdir()) if f.name in TOKENIZER_FILES} if p.is_dir() \
        else {"tokenizer.json": p.read_bytes()}
    if "tokenizer.json" not in files:
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError(f"--tokenizer: {path} has no tokenizer.json and loads as a slow tokenizer; save it "
                              "with a fast tokenizer (tokenizer.save_pretrained) first")
        files["tokenizer.json"] = backend.to_str().encode()
    return files


# --------------------------------------------------------------------------------------------------- job
@dataclass
class _Job:
    """What every worker needs; set before the pool forks, so nothing is pickled but shard numbers."""
    out: Path
    sources: list
    rows: int
    docs_per_shard: int
    tokenizer: object
    eos_id: int
    dtype: np.dtype
    this: dict                     # {"identity": ..., "labels": ...}, copied into every done-record


_JOB: _Job | None = None


def _done_path(out: Path, k: int) -> Path:
    return out / f"{_shard_name(k)}.done.json"


def _prepare_shard(k: int) -> tuple[int, dict]:
    """Tokenize rows [k*D, (k+1)*D) into shard k and record it; -> (k, the done-record)."""
    job = _JOB
    text_bytes = 0

    def documents():
        nonlocal text_bytes
        rows = _rows(job.sources, k * job.docs_per_shard, min((k + 1) * job.docs_per_shard, job.rows))
        for batch in iter_docs(rows):
            text_bytes += sum(len(t.encode()) for t in batch)
            for ids in encode(job.tokenizer, batch):
                yield np.array([*ids, job.eos_id], dtype=job.dtype)

    record = {"shard": _shard_name(k), **write_shard(job.out / _shard_name(k), documents(), job.dtype),
              "text_bytes": text_bytes, **job.this}
    atomic_write(_done_path(job.out, k), lambda f: f.write(json.dumps(record, indent=1).encode()))
    return k, record


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one core per worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C goes to the parent, which stops the pool
    try:                                             # die with the parent (a SIGKILLed run leaves no workers)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _finished(out: Path, k: int, identity: dict) -> dict | None:
    """Shard k's done-record if it is from this identity and its files have the recorded sizes."""
    try:
        record = json.loads(_done_path(out, k).read_bytes())
        name = out / _shard_name(k)
        sizes = (os.path.getsize(f"{name}.bin"), os.path.getsize(f"{name}.idx"))
    except (OSError, ValueError):
        return None
    if record.get("identity") != identity or sizes != (record.get("bin_bytes"), record.get("idx_bytes")):
        return None
    return record


def _mismatch(old: dict, new: dict) -> str | None:
    """What makes a recorded dataset another one than this run's, in words; None if the same. ``old``/``new``
    hold ``identity`` (what must match) and ``labels`` (the names a user gave, for the message)."""
    (oid, olab), (nid, nlab) = (old.get("identity", {}), old.get("labels", {})), (new["identity"], new["labels"])
    if oid.get("tokenizer_sha256") != nid["tokenizer_sha256"]:
        return (f"tokenizer {olab.get('tokenizer')} (sha256 {str(oid.get('tokenizer_sha256'))[:12]}), this run's is "
                f"{nlab['tokenizer']} (sha256 {nid['tokenizer_sha256'][:12]})")
    if oid.get("inputs_sha256") != nid["inputs_sha256"]:
        return (f"inputs {olab.get('inputs')} ({olab.get('files')} files; sha256 {str(oid.get('inputs_sha256'))[:12]} "
                f"of their names, sizes and mtimes), this run's are {nlab['inputs']} ({nlab['files']} files; sha256 "
                f"{nid['inputs_sha256'][:12]})")
    for key in sorted(set(oid) | set(nid)):
        if oid.get(key) != nid.get(key):
            return f"{key}={oid.get(key)}, this run has {key}={nid.get(key)}"
    return None


def _check_output(out: Path, this: dict) -> dict | None:
    """Refuse an OUTPUT that holds another dataset; -> its manifest when it holds this run's, finished."""
    recorded = {}
    for f in [out / MANIFEST, *sorted(out.glob("shard-*.done.json"))]:
        try:
            recorded[f.name] = json.loads(f.read_bytes())
        except (OSError, ValueError):   # absent, or half a file from a killed run: redone
            pass
    for name, old in recorded.items():
        if why := _mismatch(old, this):
            raise ConfigError(f"--output: {out / name} was prepared with {why}; use another --output or delete {out}")
    return recorded.get(MANIFEST)


def _lock(out: Path) -> int:
    """An exclusive lock on the OUTPUT directory itself (released when the process ends, however it ends)."""
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"--output: another prepare_data run is writing to {out}") from None
    return fd


def _manifest(this: dict, vocab_size: int, records: list[dict]) -> dict:
    shards = [{"name": r["shard"], **{k: r[k] for k in ("tokens", "docs", "bin_bytes", "idx_bytes", "bin_sha256",
                                                           "idx_sha256")}} for r in records]
    ident = this["identity"]
    return {"format": FORMAT, "version": FORMAT_VERSION, "dtype": ident["dtype"],
            "num_tokens": sum(s["tokens"] for s in shards), "num_docs": sum(s["docs"] for s in shards),
            "tokenizer": {"name": this["labels"]["tokenizer"], "sha256": ident["tokenizer_sha256"],
                          "vocab_size": vocab_size, "eos_id": ident["eos_id"], "dir": "tokenizer"},
            **this, "shards": shards}


def _write_tokenizer(out: Path, tok_files: dict[str, bytes]) -> None:
    """OUTPUT/tokenizer/ holds exactly ``tok_files`` (other files: from a run killed before it recorded a shard)."""
    for stale in out.glob(".*.tmp"):       # half-written files of a killed run
        stale.unlink()
    (out / "tokenizer").mkdir(exist_ok=True)
    for f in (out / "tokenizer").iterdir():
        if f.name not in tok_files:
            f.unlink()
    for name, data in tok_files.items():
        atomic_write(out / "tokenizer" / name, lambda f, d=data: f.write(d))


def _remove_unrecorded(out: Path, todo: list[int], n_shards: int) -> None:
    """Drop the done-records of shards to redo, and shard files beyond the last shard (an unrecorded run's)."""
    for k in todo:
        _done_path(out, k).unlink(missing_ok=True)
    for f in out.glob("shard-*"):
        if (m := re.fullmatch(r"shard-(\d+)\.(bin|idx|done\.json)", f.name)) and int(m.group(1)) >= n_shards:
            f.unlink()


def _run_shards(todo: list[int], records: dict, shard_rows: list[int], workers: int, progress: bool) -> None:
    """Prepare shards ``todo`` (in a fork pool when workers > 1) into ``records``, with a bar of documents."""
    from tqdm.auto import tqdm
    kill_after = int(os.environ.get(KILL_AFTER_ENV, 0))
    bar = tqdm(total=sum(shard_rows), initial=sum(shard_rows[k] for k in records), unit="doc", unit_scale=True,
               desc="prepare_data", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    pool = multiprocessing.get_context("fork").Pool(workers, _worker_init) if workers > 1 and len(todo) > 1 else None
    try:
        for n, (k, record) in enumerate(pool.imap_unordered(_prepare_shard, todo) if pool
                                        else map(_prepare_shard, todo), 1):
            records[k] = record
            bar.update(shard_rows[k])
            if n == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        bar.close()
        if pool:
            pool.terminate()
            pool.join()


def _summary(out: Path, records: list[dict], new: list[dict], t0: float) -> dict:
    return {"documents": sum(r["docs"] for r in records), "tokens": sum(r["tokens"] for r in records),
            "shards": len(records), "reused": len(records) - len(new), "text_bytes": sum(r["text_bytes"] for r in new),
            "new_tokens": sum(r["tokens"] for r in new), "seconds": time.perf_counter() - t0, "output": str(out)}


def prepare(inputs: list[str], output: str, tokenizer: str, text_field: str = "text", workers: int = 1,
            docs_per_shard: int = 100_000, cache_dir: str | None = None, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``output`` (see the module docstring); -> a summary dict."""
    global _JOB
    t0 = time.perf_counter()
    if docs_per_shard < 1 or workers < 1:
        raise ConfigError(f"--docs-per-shard ({docs_per_shard}) and --workers ({workers}) must be >= 1")
    if not Path(os.path.expanduser(tokenizer)).exists():
        raise ConfigError(f"--tokenizer: {tokenizer} does not exist (a local HF tokenizer directory or tokenizer.json)")
    out = Path(os.path.expanduser(output))
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        tok, _ = load_tokenizer(tokenizer)
        eos_id = find_eos_id(tok, tokenizer)
        tok_files = _tokenizer_files(tokenizer, tok)
        resolved = [_resolve_input(a) for a in inputs]
        this = {"identity": {"tokenizer_sha256": hashlib.sha256(tok_files["tokenizer.json"]).hexdigest(),
                             "inputs_sha256": hashlib.sha256(json.dumps([r[2] for r in resolved]).encode()).hexdigest(),
                             "eos_id": eos_id, "dtype": token_dtype(len(tok)).name, "text_field": text_field,
                             "docs_per_shard": docs_per_shard},
                "labels": {"tokenizer": str(tokenizer), "inputs": list(inputs),
                           "files": sum(len(r[1]) for r in resolved)}}
        done = _check_output(out, this)
        if done is not None:
            try:                   # already prepared; open_tokens checks that every shard is there
                open_tokens(out)
                return _summary(out, [{"shard": s["name"], "text_bytes": 0, **s} for s in done["shards"]], [], t0)
            except ConfigError:    # damaged since: redo what is missing
                (out / MANIFEST).unlink()
        _write_tokenizer(out, tok_files)
        cache = Path(os.path.expanduser(cache_dir)) if cache_dir else out / ".cache"
        sources = _load_inputs(resolved, text_field, cache)
        rows = sum(len(ds) for ds in sources)
        if rows == 0:
            raise ConfigError(f"--input: {' '.join(inputs)} holds no documents")
        n_shards = -(-rows // docs_per_shard)
        shard_rows = [min(docs_per_shard, rows - k * docs_per_shard) for k in range(n_shards)]
        records = {k: r for k in range(n_shards) if (r := _finished(out, k, this["identity"]))}
        todo = [k for k in range(n_shards) if k not in records]
        _remove_unrecorded(out, todo, n_shards)
        _JOB = _Job(out, sources, rows, docs_per_shard, tok, eos_id, np.dtype(this["identity"]["dtype"]), this)
        try:
            _run_shards(todo, records, shard_rows, workers, progress)
        finally:
            _JOB = None
        ordered = [records[k] for k in range(n_shards)]
        manifest = _manifest(this, len(tok), ordered)
        atomic_write(out / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        if not cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
        return _summary(out, ordered, [records[k] for k in todo], t0)
    finally:
        os.close(lock)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.prepare_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", action="extend", required=True,
                        help="files (.txt .jsonl .json .parquet, .jsonl.gz .json.gz .txt.gz), globs, directories or "
                             "save_to_disk datasets; read in the order given")
    parser.add_argument("--output", required=True, help="dataset directory (created; resumable)")
    parser.add_argument("--tokenizer", help="HF tokenizer directory or tokenizer.json (required)")
    parser.add_argument("--text-field", default="text", help="text column of json/parquet inputs (default: text)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="tokenizing processes (default: min(8, cpus)); the output does not depend on it")
    parser.add_argument("--docs-per-shard", type=int, default=100_000, help="input rows per shard (default 100000)")
    parser.add_argument("--cache-dir", help="datasets' Arrow cache of the inputs (default: OUTPUT/.cache, removed "
                                            "when done)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    use_offline_hub()
    try:
        if not args.tokenizer:
            raise ConfigError("--tokenizer: required (a HF tokenizer directory or tokenizer.json; token shards "
                              "belong to one tokenizer, the one your model trains with)")
        s = prepare(args.input, args.output, args.tokenizer, args.text_field, args.workers, args.docs_per_shard,
                    args.cache_dir, progress=not args.no_progress)
    except (ConfigError, OSError) as e:
        msg = str(e)
        for key, flag in _KEYS.items():
            msg = msg.replace(key, flag)
        print(f"prepare_data: error: {msg}", file=sys.stderr)
        return 2
    secs = max(s["seconds"], 1e-9)
    rates = (f"{s['text_bytes'] / secs / 1e6:.2f} MB/s of text, {s['new_tokens'] / secs:,.0f} tokens/s"
             if s["reused"] < s["shards"] else "nothing to do")
    print(f"prepare_data: {s['documents']:,} documents, {s['tokens']:,} tokens in {s['shards']} shards "
          f"({s['reused']} reused) -> {s['output']}; {secs:.1f} s, {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
