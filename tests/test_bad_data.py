"""A token id outside the vocabulary in a token dataset (a corrupted shard, data from another tokenizer): named
where the batch is built (shard file, document, position), or skipped deterministically with
``data.on_bad_document=skip`` so every rank and every resume reads the same windows."""
import logging

import numpy as np
import pytest

from data import BadDocument, BlendedBatches, blend_val_batches, open_tokens
from data.shards import write_shard

from .trainer_utils import fast_overrides, read_jsonl, run_cli

VOCAB, SEQ = 1024, 16


def _docs(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, VOCAB, rng.integers(5, 40)), 0) for _ in range(n)]


@pytest.fixture
def corrupted(tmp_path):
    """Two shards of one dataset (an empty document among them); document 45 (shard b's 5th) holds one token id
    65535 at position 3."""
    a, b = _docs(0, 40), _docs(1, 30)
    b[3] = np.zeros(0, dtype=np.int64)
    b[5] = b[5].copy()
    b[5][3] = 65535
    write_shard(tmp_path / "shard_a", a, np.uint16)
    write_shard(tmp_path / "shard_b", b, np.uint16)
    src = open_tokens(tmp_path)
    bad_pos = sum(map(len, a)) + sum(map(len, b[:5])) + 3
    return src, bad_pos, str(tmp_path / "shard_b.bin")


def test_locate_names_shard_document_and_position(corrupted):
    src, bad_pos, shard = corrupted
    assert src.locate(bad_pos) == (shard, 45, 3)
    assert src.read(bad_pos, bad_pos + 1).tolist() == [65535]
    assert src.locate(0)[1:] == (0, 0)
    first_b = src.num_tokens - sum(len(src.document(i)) for i in range(40, 70))
    assert src.locate(first_b) == (shard, 40, 0)
    after_empty = first_b + sum(len(src.document(i)) for i in range(40, 43))      # document 43 is empty
    assert src.locate(after_empty)[1:] == (44, 0)
    assert src.locate(src.num_tokens - 1)[1:] == (69, len(src.document(69)) - 1)
    with pytest.raises(IndexError):
        src.locate(src.num_tokens)


def _all_batches(src, steps, g=8, **kw):
    """(the stream, its batches as inputs with the last label appended: the whole windows)."""
    b = BlendedBatches([src], [1.0], ["web"], SEQ, seed=3, vocab_size=VOCAB, **kw)
    return b, [np.concatenate([x, y[:, -1:]], axis=1) for x, y in (map(np.asarray, b.next_batch(g)) for _ in range(steps))]


def test_error_names_the_document_in_one_line(corrupted):
    src, _, shard = corrupted
    b = BlendedBatches([src], [1.0], ["web"], SEQ, seed=3, vocab_size=VOCAB)
    with pytest.raises(BadDocument) as e:
        for _ in range(20):                     # 20 batches of 8 cover every window once (one epoch ~ 100)
            b.next_batch(8)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.blend: source web: token id 65535 outside model.vocab_size=1024")
    assert f"at {shard}, document 45, position 3" in msg and "data.on_bad_document=skip" in msg


def test_skip_is_deterministic_across_ranks_and_resumes(corrupted, caplog):
    src, _, _ = corrupted
    with caplog.at_level(logging.WARNING, logger="data.blend"):
        b, straight = _all_batches(src, 30, on_bad_document="skip")
    assert all(int(x.max()) < VOCAB for x in straight)
    assert b.skipped_windows >= 1 and b.source_metrics()["skipped_windows"] == b.skipped_windows
    warned = [r.getMessage() for r in caplog.records if "65535" in r.getMessage()]
    assert len(warned) == 1 and "document 45, position 3" in warned[0] and "skipped" in warned[0]
    # another data-parallel size, and a resume half way, read the same rows
    ranks = [BlendedBatches([src], [1.0], ["web"], SEQ, seed=3, dp_rank=r, dp_size=2, vocab_size=VOCAB,
                            on_bad_document="skip") for r in range(2)]
    split = [np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in (map(np.asarray, r.next_batch(8))
                                                                                  for r in ranks)]) for _ in range(15)]
    resumed = BlendedBatches([src], [1.0], ["web"], SEQ, seed=3, vocab_size=VOCAB, on_bad_document="skip")
    resumed.load_state_dict(ranks[0].state_dict())
    split += [np.concatenate([x, y[:, -1:]], axis=1) for x, y in (map(np.asarray, resumed.next_batch(8))
                                                                   for _ in range(15))]
    assert all(np.array_equal(x, y) for x, y in zip(straight, split))


def test_clean_data_reads_as_without_the_check(tmp_path):
    write_shard(tmp_path / "clean", _docs(2, 50), np.uint16)
    src = open_tokens(tmp_path)
    checked = BlendedBatches([src], [1.0], ["web"], SEQ, seed=1, vocab_size=VOCAB)
    plain = BlendedBatches([src], [1.0], ["web"], SEQ, seed=1)
    for _ in range(10):
        assert np.array_equal(checked.next_batch(4)[0].numpy(), plain.next_batch(4)[0].numpy())
    assert "skipped_windows" not in checked.source_metrics()


def test_validation_windows(corrupted):
    src, bad_pos, shard = corrupted
    with pytest.raises(BadDocument, match=r"^data\.val_blend: source val: token id 65535 .*document 45, position 3"):
        blend_val_batches([src], ["val"], SEQ, 4, 0, vocab_size=VOCAB)
    kept = blend_val_batches([src], ["val"], SEQ, 4, 0, vocab_size=VOCAB, on_bad_document="skip")["val"]
    everything = blend_val_batches([src], ["val"], SEQ, 4, 0)["val"]
    assert sum(len(x) for x, _ in kept) == sum(len(x) for x, _ in everything) - 1
    assert all(int(x.max()) < VOCAB and int(y.max()) < VOCAB for x, y in kept)


def test_trainer_stops_with_one_line_or_skips(tmp_path, corrupted):
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), f"data.blend=[{{path: {tmp_path}}}]",
              "train.global_batch_size=8", "train.micro_batch_size=4", f"data.seq_len={SEQ}", "train.max_steps=25",
              "train.eval_every=0", "checkpoint.save_final=false"]
    bad = run_cli(*common, f"hydra.run.dir={tmp_path}/a", timeout=240)
    assert bad.returncode == 2, bad.stderr[-2000:]
    lines = [ln for ln in bad.stderr.splitlines() if "65535" in ln]
    assert len(lines) == 1 and "document 45, position 3" in lines[0] and "Traceback" not in bad.stderr
    ok = run_cli(*common, "data.on_bad_document=skip", f"hydra.run.dir={tmp_path}/b", timeout=240)
    assert ok.returncode == 0, ok.stderr[-2000:]
    rows = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert len(rows) == 25 and rows[-1].get("skipped_windows", 0) >= 1
    assert all(np.isfinite(r["loss"]) for r in rows)
