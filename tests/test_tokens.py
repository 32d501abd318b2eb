"""data/shards.py: Megatron indexed-dataset shards, written by us or by a reference writer, read back.

The reference writer and parser below follow Megatron-LM's documented ``.idx`` layout with struct/numpy and
share no code with data/shards.py, so the two check each other."""
import hashlib
import json
import os
import pickle
import struct
import time

import numpy as np
import pytest

from errors import ConfigError
from data.shards import MANIFEST, open_tokens, verify, write_shard

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


# --------------------------------------------------------------------------- reference writer / parser
def ref_write(prefix, docs, dtype, seqs_per_doc=1, modes=False):
    """Megatron layout: each document split into ``seqs_per_doc`` sequences; optional int8 sequence_modes."""
    seqs, doc_idx = [], [0]
    for d in docs:
        seqs += np.array_split(np.asarray(d, dtype=dtype), seqs_per_doc)
        doc_idx.append(len(seqs))
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    lengths = [len(s) for s in seqs]
    pointers = (np.cumsum([0] + lengths)[:-1] * np.dtype(dtype).itemsize).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers.tolist()))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
        if modes:
            f.write(bytes(len(seqs)))


def ref_read(prefix):
    """-> (numpy dtype, list of documents) from a .bin/.idx pair."""
    raw = open(f"{prefix}.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert version == 1
    dtype = {v: k for k, v in CODES.items()}[code]
    lengths = struct.unpack(f"<{n_seq}i", raw[34:34 + 4 * n_seq])
    pointers = struct.unpack(f"<{n_seq}q", raw[34 + 4 * n_seq:34 + 12 * n_seq])
    doc_idx = struct.unpack(f"<{n_doc}q", raw[34 + 12 * n_seq:34 + 12 * n_seq + 8 * n_doc])
    assert len(raw) == 34 + 12 * n_seq + 8 * n_doc and doc_idx[0] == 0 and doc_idx[-1] == n_seq
    data = open(f"{prefix}.bin", "rb").read()
    size = np.dtype(dtype).itemsize
    le = np.dtype(dtype).newbyteorder("<")
    seqs = [np.frombuffer(data[p:p + n * size], dtype=le) for p, n in zip(pointers, lengths)]
    docs = [np.concatenate(seqs[a:b]) if b > a else np.zeros(0, dtype) for a, b in zip(doc_idx, doc_idx[1:])]
    return np.dtype(dtype), docs


def random_docs(n, vocab, seed, max_len=50):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, max_len), dtype=np.int64) for _ in range(n)]


def write_manifest(d, names, dtype, vocab_size=None):
    """A manifest as tools.prepare_data writes it (the keys open_tokens/verify read)."""
    shards = []
    for name in names:
        _, docs = ref_read(d / name)
        shards.append({"name": name, "tokens": int(sum(len(x) for x in docs)), "docs": len(docs),
                       "bin_sha256": hashlib.sha256((d / f"{name}.bin").read_bytes()).hexdigest(),
                       "idx_sha256": hashlib.sha256((d / f"{name}.idx").read_bytes()).hexdigest()})
    m = {"format": "dsv3-tokens", "version": 1, "dtype": np.dtype(dtype).name,
         "tokenizer": {"sha256": "ab" * 32, "vocab_size": vocab_size, "eos_id": 0}, "shards": shards}
    (d / MANIFEST).write_text(json.dumps(m))


# ------------------------------------------------------------------------------------------------ reading
@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65536), (np.int32, 200_000)])
def test_reads_reference_megatron_shard(tmp_path, dtype, vocab):
    docs = random_docs(30, vocab, seed=1)
    ref_write(tmp_path / "corpus_text_document", docs, dtype)
    stream = np.concatenate(docs)
    for given in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        src = open_tokens(tmp_path / given)
        assert (src.num_docs, src.num_tokens, src.dtype) == (30, len(stream), np.dtype(dtype))
        assert src.vocab_size is None and src.eos_id is None and src.tokenizer_hash is None
        for i, d in enumerate(docs):
            got = src.document(i)
            assert got.dtype == np.int64 and np.array_equal(got, d)
        assert np.array_equal(src.read(0, src.num_tokens), stream)
        assert np.array_equal(src.read(7, 91), stream[7:91]) and len(src.read(5, 5)) == 0


def test_multi_sequence_documents_and_sequence_modes(tmp_path):
    """Megatron's --split-sentences data (several sequences per document) and multimodal sequence_modes."""
    docs = [d for d in random_docs(12, 1000, seed=2) if len(d) >= 3]
    ref_write(tmp_path / "split", docs, np.uint16, seqs_per_doc=3, modes=True)
    src = open_tokens(tmp_path / "split")
    assert src.num_docs == len(docs)
    assert all(np.array_equal(src.document(i), d) for i, d in enumerate(docs))
    assert np.array_equal(src.read(0, src.num_tokens), np.concatenate(docs))


def test_read_across_shards_of_a_megatron_directory(tmp_path):
    parts = [random_docs(n, 5000, seed=s) for s, n in ((3, 9), (4, 0), (5, 1), (6, 14))]   # an empty shard too
    for k, docs in enumerate(parts):
        ref_write(tmp_path / f"part-{k}", docs, np.uint16)
    all_docs = [d for docs in parts for d in docs]
    stream = np.concatenate(all_docs)
    src = open_tokens(tmp_path)
    assert src.shard_prefixes == [str(tmp_path / f"part-{k}") for k in range(4)]
    assert (src.num_docs, src.num_tokens) == (len(all_docs), len(stream))
    rng = np.random.default_rng(0)
    for a, b in [(0, len(stream))] + [tuple(sorted(rng.integers(0, len(stream) + 1, 2))) for _ in range(50)]:
        assert np.array_equal(src.read(a, b), stream[a:b])
    assert all(np.array_equal(src.document(i), d) for i, d in enumerate(all_docs))
    with pytest.raises(IndexError):
        src.read(0, len(stream) + 1)
    with pytest.raises(IndexError):
        src.document(len(all_docs))


def test_lru_of_open_shards_and_pickling(tmp_path, monkeypatch):
    import data.shards as tokens
    monkeypatch.setattr(tokens, "_OPEN_SHARDS", 2)
    parts = [random_docs(3, 100, seed=s) for s in range(5)]
    for k, docs in enumerate(parts):
        ref_write(tmp_path / f"p{k}", docs, np.uint16)
    src = open_tokens(tmp_path)
    stream = np.concatenate([d for docs in parts for d in docs])
    assert np.array_equal(src.read(0, src.num_tokens), stream)     # touches all 5 shards
    assert len(src._maps) == 2
    clone = pickle.loads(pickle.dumps(src))
    assert len(pickle.dumps(src)) < 4000 and not clone._maps
    assert np.array_equal(clone.read(0, clone.num_tokens), stream)


# ------------------------------------------------------------------------------------------------ writing
@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65536), (np.int32, 1 << 31)])
def test_write_shard_parsed_by_reference(tmp_path, dtype, vocab):
    docs = random_docs(40, vocab, seed=7) + [np.zeros(0, np.int64)]
    info = write_shard(tmp_path / "s", iter(docs), dtype)
    got_dtype, got = ref_read(tmp_path / "s")
    assert got_dtype == np.dtype(dtype) and len(got) == len(docs)
    assert all(np.array_equal(a, b) for a, b in zip(got, docs))
    assert info["tokens"] == sum(len(d) for d in docs) and info["docs"] == len(docs)
    for kind in ("bin", "idx"):
        data = (tmp_path / f"s.{kind}").read_bytes()
        assert info[f"{kind}_bytes"] == len(data) and info[f"{kind}_sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]     # no temp files left


def test_write_shard_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="70000 does not fit uint16"):
        write_shard(tmp_path / "s", [np.array([1, 70000])], np.uint16)
    assert not list(tmp_path.iterdir())


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "e", [], np.uint16)
    src = open_tokens(tmp_path / "e")
    assert (src.num_docs, src.num_tokens) == (0, 0) and len(src.read(0, 0)) == 0


# ------------------------------------------------------------------------------------------------- errors
def _error(path) -> str:
    with pytest.raises(ConfigError) as e:
        open_tokens(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_errors_name_the_file(tmp_path):
    docs = random_docs(5, 100, seed=8)

    def fresh(name):
        ref_write(tmp_path / name, docs, np.uint16)
        return tmp_path / name

    p = fresh("magic")
    raw = bytearray(open(f"{p}.idx", "rb").read())
    raw[0:3] = b"XXX"
    open(f"{p}.idx", "wb").write(raw)
    assert "magic.idx" in (m := _error(p)) and "bad magic" in m

    p = fresh("version")
    raw[0:3] = b"MMI"
    raw[9:17] = struct.pack("<Q", 2)
    open(f"{p}.idx", "wb").write(raw)
    assert "version.idx" in (m := _error(p)) and "version 2" in m

    p = fresh("code")
    raw[9:17] = struct.pack("<Q", 1)
    raw[17] = 6                           # float64: not a token dtype
    open(f"{p}.idx", "wb").write(raw)
    assert "code.idx" in (m := _error(p)) and "dtype code 6" in m

    p = fresh("short")
    os.truncate(f"{p}.bin", os.path.getsize(f"{p}.bin") - 2)
    assert "short.bin" in (m := _error(p)) and "bytes" in m

    p = fresh("noidx")
    os.truncate(f"{p}.idx", 40)
    assert "noidx.idx" in _error(p)

    p = fresh("nobin")
    os.unlink(f"{p}.bin")
    assert "nobin.bin" in (m := _error(p)) and "missing" in m

    assert "nothing" in _error(tmp_path / "nothing")
    (tmp_path / "empty_dir").mkdir()
    assert "empty_dir" in _error(tmp_path / "empty_dir")


def test_manifest_errors(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    for k in range(2):
        ref_write(d / f"shard-{k:05d}", random_docs(4, 100, seed=k), np.uint16)
    write_manifest(d, ["shard-00000", "shard-00001"], np.uint16, vocab_size=100)
    assert open_tokens(d).num_docs == 8
    os.unlink(d / "shard-00001.bin")
    assert "shard-00001.bin" in (m := _error(d)) and MANIFEST in m and "missing" in m
    m = json.loads((d / MANIFEST).read_text())
    m["version"] = 9
    (d / MANIFEST).write_text(json.dumps(m))
    assert "version 9" in _error(d)


# ------------------------------------------------------------------------------------------- verify / identity
def test_verify_detects_a_flipped_byte(tmp_path):
    for k in range(2):
        ref_write(tmp_path / f"shard-{k:05d}", random_docs(6, 300, seed=k), np.uint16)
    write_manifest(tmp_path, ["shard-00000", "shard-00001"], np.uint16, vocab_size=300)
    assert verify(tmp_path) == []
    f = tmp_path / "shard-00001.bin"
    raw = bytearray(f.read_bytes())
    raw[2] ^= 0x01                                     # low byte of token 1: still < vocab_size
    f.write_bytes(raw)
    problems = verify(tmp_path)
    assert len(problems) == 1 and "shard-00001.bin" in problems[0] and "sha256" in problems[0]
    raw[2] ^= 0x01                                     # restored
    raw[4:6] = np.array([5000], "<u2").tobytes()      # an id beyond vocab_size (and another sha256)
    f.write_bytes(raw)
    assert any("token id 5000 >= vocab_size 300" in p for p in verify(tmp_path))
    assert "missing" in verify(tmp_path / "missing")[0]


def test_fingerprint(tmp_path):
    ref_write(tmp_path / "a", random_docs(3, 100, seed=1), np.uint16)
    fp = open_tokens(tmp_path / "a").fingerprint()
    assert open_tokens(tmp_path / "a.bin").fingerprint() == fp
    st = os.stat(tmp_path / "a.bin")
    os.utime(tmp_path / "a.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert open_tokens(tmp_path / "a").fingerprint() != fp
    d = tmp_path / "m"
    d.mkdir()
    ref_write(d / "shard-00000", random_docs(3, 100, seed=1), np.uint16)
    write_manifest(d, ["shard-00000"], np.uint16)
    assert open_tokens(d).fingerprint().startswith("manifest-")


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_open_does_not_read_the_bin(tmp_path):
    """An 8 GB (sparse) .bin: opening reads only the index; a read touches only its pages."""
    n_seq, per_seq = 4, 1_000_000_000               # 4 x 1e9 uint16 tokens = 8 GB
    pointers = np.arange(n_seq, dtype=np.int64) * per_seq * 2
    with open(tmp_path / "huge.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n_seq, n_seq + 1))
        f.write(np.full(n_seq, per_seq, "<i4").tobytes() + pointers.astype("<i8").tobytes()
                + np.arange(n_seq + 1, dtype="<i8").tobytes())
    with open(tmp_path / "huge.bin", "wb"):
        pass
    os.truncate(tmp_path / "huge.bin", n_seq * per_seq * 2)
    rss, t = _rss_bytes(), time.perf_counter()
    src = open_tokens(tmp_path / "huge")
    tail = src.read(src.num_tokens - 5, src.num_tokens)
    head = src.read(0, 1000)
    assert time.perf_counter() - t < 1.0
    assert _rss_bytes() - rss < 32 << 20
    assert src.num_tokens == n_seq * per_seq and src.num_docs == n_seq
    assert not tail.any() and not head.any()
