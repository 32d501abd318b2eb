"""data/corpus.py: offline corpus loading, tokenizer/token caching, packed resumable batches."""
import json
import logging
import time
import types

import numpy as np
import pytest
import torch

from errors import ConfigError
from data import PackedBatches, load_corpus, val_batches


def _cfg(cache_dir, **kw):
    base = dict(path=None, tokenizer=None, seq_len=8, text_field="text", val_fraction=0.05, cache_dir=str(cache_dir))
    base.update(kw)
    return types.SimpleNamespace(**base)


PARAS = [f"Paragraph {i}: the {['quick', 'lazy', 'brown'][i % 3]} fox number {i} jumps over {i * 7} dogs."
         for i in range(40)]


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def default_corpus(default_cache):
    return load_corpus(_cfg(default_cache), 1024)


# ------------------------------------------------------------------------------------------ load_corpus
def test_default_corpus_offline(default_corpus):
    c = default_corpus
    assert c.train_tokens.dtype == np.int32 and c.val_tokens.dtype == np.int32
    assert c.train_tokens.ndim == 1 and len(c.train_tokens) > 10_000 and len(c.val_tokens) > 100
    assert c.vocab_size == len(c.tokenizer) <= 1024
    for arr in (c.train_tokens, c.val_tokens):
        assert arr.min() >= 0 and arr.max() < c.vocab_size
        assert arr[-1] == c.eos_id                          # every document is followed by EOS
    assert c.tokenizer.convert_ids_to_tokens(c.eos_id) == "<|endoftext|>"
    assert (c.train_tokens == c.eos_id).sum() > (c.val_tokens == c.eos_id).sum() >= 1


def test_tokenizer_round_trip(default_corpus):
    tok = default_corpus.tokenizer
    for s in ["The assert statement.\n\n    Indented  code:  x = 1", "Unicode: naïve café — ✓ 日本", ""]:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    # the stream decodes back to the original help text
    assert "assert" in tok.decode(default_corpus.train_tokens[:50].tolist())


def test_cache_hit(default_corpus, default_cache):
    files = sorted(p.name for p in default_cache.iterdir())
    t = time.perf_counter()
    again = load_corpus(_cfg(default_cache), 1024)
    assert time.perf_counter() - t < 1.0
    assert sorted(p.name for p in default_cache.iterdir()) == files      # nothing new written
    np.testing.assert_array_equal(again.train_tokens, default_corpus.train_tokens)
    np.testing.assert_array_equal(again.val_tokens, default_corpus.val_tokens)
    assert again.eos_id == default_corpus.eos_id
    assert not [p for p in default_cache.iterdir() if p.name.endswith(".tmp")]


def test_cache_keys_do_not_collide(default_corpus, default_cache):
    other = load_corpus(_cfg(default_cache), 512)     # different vocab -> new tokenizer and token arrays
    assert other.vocab_size <= 512 and other.train_tokens.max() < 512
    assert len(other.train_tokens) != len(default_corpus.train_tokens)
    assert len(list(default_cache.glob("tokenizer-*.json"))) == 2


def _check_user(c, vocab=400):
    assert len(c.train_tokens) > 0 and len(c.val_tokens) > 0
    assert c.train_tokens.max() < c.vocab_size <= vocab


def test_txt_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("\n\n".join(PARAS))
    c = load_corpus(_cfg(tmp_path / "cache", path=str(f), val_fraction=0.1), 400)
    _check_user(c)
    assert (c.train_tokens == c.eos_id).sum() + (c.val_tokens == c.eos_id).sum() == len(PARAS)  # 1 doc per paragraph
    # editing the file invalidates the cache
    f.write_text("\n\n".join(PARAS[:10]))
    c2 = load_corpus(_cfg(tmp_path / "cache", path=str(f), val_fraction=0.1), 400)
    assert (c2.train_tokens == c2.eos_id).sum() + (c2.val_tokens == c2.eos_id).sum() == 10


def test_jsonl_custom_field_and_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for k in range(2):
        with open(d / f"part{k}.jsonl", "w") as fh:
            for p in PARAS[k::2]:
                fh.write(json.dumps({"content": p, "id": 1}) + "\n")
    c = load_corpus(_cfg(tmp_path / "cache", path=str(d), text_field="content"), 400)
    _check_user(c)
    assert (c.train_tokens == c.eos_id).sum() + (c.val_tokens == c.eos_id).sum() == len(PARAS)
    g = load_corpus(_cfg(tmp_path / "cache", path=str(d / "part*.jsonl"), text_field="content"), 400)  # glob
    np.testing.assert_array_equal(g.train_tokens, c.train_tokens)


def test_parquet_file(tmp_path):
    import datasets
    f = tmp_path / "d.parquet"
    datasets.Dataset.from_dict({"text": PARAS}).to_parquet(str(f))
    _check_user(load_corpus(_cfg(tmp_path / "cache", path=str(f)), 400))


def test_save_to_disk_dataset(tmp_path):
    import datasets
    datasets.Dataset.from_dict({"body": PARAS}).save_to_disk(str(tmp_path / "ds"))
    _check_user(load_corpus(_cfg(tmp_path / "cache", path=str(tmp_path / "ds"), text_field="body"), 400))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": PARAS[:30]}),
                               "validation": datasets.Dataset.from_dict({"text": PARAS[30:]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    c = load_corpus(_cfg(tmp_path / "cache", path=str(tmp_path / "dd")), 400)
    _check_user(c)
    assert (c.train_tokens == c.eos_id).sum() + (c.val_tokens == c.eos_id).sum() == len(PARAS)


def test_user_tokenizer_dir_and_file(default_corpus, tmp_path):
    default_corpus.tokenizer.save_pretrained(str(tmp_path / "tok"))
    c = load_corpus(_cfg(tmp_path / "cache", tokenizer=str(tmp_path / "tok")), 1024)
    np.testing.assert_array_equal(c.train_tokens, default_corpus.train_tokens)
    c2 = load_corpus(_cfg(tmp_path / "cache", tokenizer=str(tmp_path / "tok" / "tokenizer.json")), 1024)
    assert c2.eos_id == default_corpus.eos_id
    np.testing.assert_array_equal(c2.val_tokens, default_corpus.val_tokens)


def _raises(key, fn):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg, msg
    return msg


def test_config_errors(tmp_path):
    _raises("data.path", lambda: load_corpus(_cfg(tmp_path, path=str(tmp_path / "nope.txt")), 400))
    _raises("data.path", lambda: load_corpus(_cfg(tmp_path, path=str(tmp_path / "*.parquet")), 400))
    (tmp_path / "empty.txt").write_text("")
    _raises("data.path", lambda: load_corpus(_cfg(tmp_path, path=str(tmp_path / "empty.txt")), 400))
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"content": p}) + "\n" for p in PARAS))
    msg = _raises("data.text_field", lambda: load_corpus(_cfg(tmp_path, path=str(f)), 400))
    assert "'text'" in msg and "content" in msg
    _raises("data.tokenizer", lambda: load_corpus(_cfg(tmp_path, tokenizer=str(tmp_path / "no_tok")), 400))
    from tokenizers import Tokenizer, models
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(2000)} | {"<|endoftext|>": 2000}, unk_token="w0"))
    big.save(str(tmp_path / "tokenizer.json"))
    msg = _raises("data.tokenizer", lambda: load_corpus(_cfg(tmp_path, tokenizer=str(tmp_path / "tokenizer.json")), 1024))
    assert "2001" in msg and "model.vocab_size" in msg


# ----------------------------------------------------------------------------------------- PackedBatches
TOK = np.arange(1000, dtype=np.int32) * 7 % 997


def _all(pb, n):
    return [pb.next_batch() for _ in range(n)]


def test_packed_shapes_and_labels():
    pb = PackedBatches(TOK, seq_len=16, global_batch_size=4, seed=0)
    assert pb.num_samples == (len(TOK) - 1) // 16
    x, y = pb.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = torch.from_numpy(TOK.astype(np.int64))
    for row_x, row_y in zip(x, y):        # each row is window i of the stream
        i = int(np.flatnonzero(TOK == int(row_x[0]))[0]) // 16
        assert torch.equal(row_x, stream[i * 16:i * 16 + 16]) and torch.equal(row_y, stream[i * 16 + 1:i * 16 + 17])


def test_packed_determinism_and_seed():
    a = _all(PackedBatches(TOK, 16, 4, seed=1), 5)
    b = _all(PackedBatches(TOK, 16, 4, seed=1), 5)
    c = _all(PackedBatches(TOK, 16, 4, seed=2), 5)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))


def test_packed_resume():
    ref = _all(PackedBatches(TOK, 16, 4, seed=3), 4)
    pb = PackedBatches(TOK, 16, 4, seed=3)
    _all(pb, 3)
    sd = pb.state_dict()
    assert sd["consumed_samples"] == 12 and all(type(v) is int for v in sd.values())
    fresh = PackedBatches(TOK, 16, 4, seed=3)
    fresh.load_state_dict(json.loads(json.dumps(sd)))
    x, y = fresh.next_batch()
    assert torch.equal(x, ref[3][0]) and torch.equal(y, ref[3][1])
    msg = _raises("train.seed", lambda: PackedBatches(TOK, 16, 4, seed=4).load_state_dict(sd))
    assert "train.seed=3" in msg and "train.seed=4" in msg and "checkpoint.resume=none" in msg
    msg = _raises("data.path", lambda: PackedBatches(TOK[:500], 16, 4, seed=3).load_state_dict(sd))  # other data
    assert "62 windows" in msg and "31" in msg


def test_packed_epoch_crossing():
    pb = PackedBatches(TOK, 16, 5, seed=0)     # 62 windows: batch 12 spans epochs 0 and 1
    n = pb.num_samples
    batches = _all(pb, 2 * n // 5 + 1)
    first = [int(r[0]) for x, _ in batches for r in x]
    starts = {int(TOK[i * 16]) for i in range(n)}
    assert set(first[:n]) == starts and set(first[n:2 * n]) == starts      # each epoch = every window once
    assert first[:n] != first[n:2 * n]                                     # reshuffled per epoch
    assert pb.epoch == 2


def test_dp_ranks_partition_global_batch():
    full = _all(PackedBatches(TOK, 16, 8, seed=5), 10)     # crosses an epoch boundary too
    ranks = [_all(PackedBatches(TOK, 16, 8, seed=5, dp_rank=r, dp_size=2), 10) for r in range(2)]
    for k in range(10):
        assert ranks[0][k][0].shape == (4, 16)
        assert torch.equal(torch.cat([ranks[0][k][0], ranks[1][k][0]]), full[k][0])
        assert torch.equal(torch.cat([ranks[0][k][1], ranks[1][k][1]]), full[k][1])


def test_packed_errors():
    with pytest.raises(ValueError):
        PackedBatches(TOK, 16, 6, seed=0, dp_size=4)
    with pytest.raises(ConfigError) as e:
        PackedBatches(TOK, 512, 4, seed=0)
    assert str(e.value).startswith("data.seq_len") and "train.global_batch_size=4" in str(e.value)


def test_val_batches():
    a = val_batches(TOK, 16, 4, max_batches=3)
    b = val_batches(TOK, 16, 4, max_batches=3)
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert torch.equal(a[0][0][0], torch.from_numpy(TOK[:16].astype(np.int64)))    # in stream order
    assert torch.equal(a[1][0][0], torch.from_numpy(TOK[64:80].astype(np.int64)))
    assert len(val_batches(TOK, 16, 4, max_batches=0)) == 62 // 4
    small = val_batches(TOK[:50], 16, 8, max_batches=2)     # fewer windows than a batch -> one short batch
    assert len(small) == 1 and small[0][0].shape == (3, 16)
    assert val_batches(TOK[:10], 16, 8, 2) == []


# ------------------------------------------------------------------------- unsupported files, empty splits
def _jsonl(path, paras):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))


def test_unsupported_files_in_a_directory_are_listed(tmp_path, caplog):
    d = tmp_path / "data"
    _jsonl(d / "part0.jsonl", PARAS)
    for name in ("README.md", "notes.csv", "sub/train.jsonl.gz"):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text("not loaded")
    with caplog.at_level(logging.WARNING, logger="data.corpus"):
        c = load_corpus(_cfg(tmp_path / "cache", path=str(d)), 400)
    _check_user(c)
    assert (c.train_tokens == c.eos_id).sum() + (c.val_tokens == c.eos_id).sum() == len(PARAS)  # the .jsonl only
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert warned[0].startswith("data.path: skipping 3 file(s)")
    assert all(n in warned[0] for n in ("README.md", "notes.csv", "sub/train.jsonl.gz")), warned[0]
    assert "part0.jsonl" not in warned[0]
    caplog.clear()                                           # a clean directory warns about nothing
    with caplog.at_level(logging.WARNING, logger="data.corpus"):
        load_corpus(_cfg(tmp_path / "cache", path=str(d / "part0.jsonl")), 400)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_unsupported_files_listed_in_errors(tmp_path):
    d = tmp_path / "only_other"
    d.mkdir()
    for name in ("a.csv", "b.md"):
        (d / name).write_text("x")
    msg = _raises("data.path", lambda: load_corpus(_cfg(tmp_path / "cache", path=str(d)), 400))
    assert "a.csv" in msg and "b.md" in msg
    mixed = tmp_path / "mixed"
    _jsonl(mixed / "a.jsonl", PARAS)
    for k in range(12):
        (mixed / f"x{k:02d}.csv").write_text("x")
    msg = _raises("data.path", lambda: load_corpus(_cfg(tmp_path / "cache", path=str(mixed / "*")), 400))  # a glob
    assert "x00.csv" in msg and "x09.csv" in msg and "and 2 more" in msg and "a.jsonl" not in msg


def test_val_fraction_zero_holds_out_nothing(tmp_path):
    f = tmp_path / "a.jsonl"
    _jsonl(f, PARAS)
    c = load_corpus(_cfg(tmp_path / "cache", path=str(f), val_fraction=0.0), 400)
    assert len(c.val_tokens) == 0 and (c.train_tokens == c.eos_id).sum() == len(PARAS)
    assert val_batches(c.val_tokens, 16, 4, max_batches=4) == []      # the trainer's signal: no validation
    _jsonl(tmp_path / "one.jsonl", PARAS[:1])      # one document is enough when none is held out
    assert len(load_corpus(_cfg(tmp_path / "cache", path=str(tmp_path / "one.jsonl"), val_fraction=0.0), 400).val_tokens) == 0
    _raises("data.path", lambda: load_corpus(_cfg(tmp_path / "cache", path=str(tmp_path / "one.jsonl")), 400))


def test_empty_validation_split_is_an_error(tmp_path):
    f = tmp_path / "a.jsonl"
    _jsonl(f, PARAS)
    ok = load_corpus(_cfg(tmp_path / "cache", path=str(f), val_fraction=0.01, seq_len=8), 400)   # one document
    assert 9 <= len(ok.val_tokens) < 65
    msg = _raises("data.val_fraction",
                  lambda: load_corpus(_cfg(tmp_path / "cache", path=str(f), val_fraction=0.01, seq_len=64), 400))
    assert f"holds out {len(ok.val_tokens)} validation tokens" in msg and "data.seq_len+1=65" in msg
    assert "data.val_fraction=0" in msg


def test_seed_change_on_resume_names_train_seed(tmp_path, default_corpus, default_cache):
    """Through the trainer: the checkpoint's data position belongs to another seed's order."""
    from trainer.train import Trainer

    from .trainer_utils import fast_overrides, make_config, run_inprocess
    common = [*fast_overrides(tmp_path, default_cache), "train.global_batch_size=4", "train.micro_batch_size=4",
              "data.seq_len=32", "train.eval_batches=1", "train.eval_every=0", "train.max_steps=1",
              f"checkpoint.dir={tmp_path}/ck", "model.n_layers=2"]
    run_inprocess(tmp_path / "a", *common)
    with pytest.raises(ConfigError) as e:
        Trainer(make_config(*common, "train.seed=7"), tmp_path / "b")
    msg = str(e.value)
    assert msg.startswith("train.seed: ") and "\n" not in msg and "train.seed=0" in msg and "train.seed=7" in msg
