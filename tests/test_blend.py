"""Weighted blends (data/blend.py) and the LR / batch-size schedules (trainer/lr_schedule.py, data/ramp.py): shares,
determinism, resumption under another data-parallel size, and the V3 schedule's values."""
import math

import numpy as np
import pytest

from configs.schema import BatchRamp, LRPhase, OptimConfig, TrainConfig
from errors import ConfigError
from data.blend import CHUNK, BlendedBatches, blend_val_batches, feistel_permute, source_pattern
from data.ramp import batch_size_at, ramp_sizes
from trainer.lr_schedule import lr_multiplier, phase_lr


class ArraySource:
    """A token source held in memory (the reader interface of data/shards.py)."""

    def __init__(self, tokens, path="mem"):
        self.tokens, self.path = np.asarray(tokens), path
        self.num_tokens = len(self.tokens)

    def read(self, start, stop):
        return self.tokens[start:stop].astype(np.int64)


def sources(seq_len=8, windows=(50, 30, 20)):
    """Source j's tokens encode (j, position): a read window tells where it came from."""
    return [ArraySource(j * 1_000_000 + np.arange(n * seq_len + 1)) for j, n in enumerate(windows)]


def global_rows(streams, sizes):
    """Global batches from per-rank streams (rank order), each batch of ``sizes[k]`` sequences."""
    out = []
    for g in sizes:
        out.append(np.concatenate([s.next_batch(g)[0].numpy() for s in streams]))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097, 65_537])
def test_feistel_is_a_permutation(n):
    p = feistel_permute(np.arange(n), n, key=7)
    assert sorted(p.tolist()) == list(range(n))


def test_feistel_depends_on_key_and_shuffles():
    a, b = feistel_permute(np.arange(1000), 1000, 1), feistel_permute(np.arange(1000), 1000, 2)
    assert (a != b).mean() > 0.9
    assert abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.2     # not close to the identity order
    assert feistel_permute(np.array([5, 999]), 1000, 1).tolist() == [a[5], a[999]]   # pointwise, no table


def test_shares_within_one_percent_over_1000_samples():
    seq = 8
    b = BlendedBatches(sources(seq, (400, 400, 400)), [0.5, 0.3, 0.2], ["a", "b", "c"], seq, seed=3)
    counts = np.bincount([s.source for s in b.samples(0, 1000)], minlength=3) / 1000
    assert np.all(np.abs(counts - [0.5, 0.3, 0.2]) <= 0.01), counts
    src, _, per_chunk = source_pattern([5, 3, 2])
    assert per_chunk.sum() == CHUNK and np.all(np.abs(per_chunk / CHUNK - [0.5, 0.3, 0.2]) < 1 / CHUNK + 1e-12)
    for p in (1, 7, 99, 1000):   # every prefix is within one sample of the shares
        assert np.all(np.abs(np.bincount(src[:p], minlength=3) - p * np.array([0.5, 0.3, 0.2])) < 1.0 + 1e-9)


def test_each_epoch_visits_every_window_once():
    seq = 8
    b = BlendedBatches(sources(seq, (37, 11)), [0.6, 0.4], ["a", "b"], seq, seed=0)
    samples = b.samples(0, 2000)
    for j, n in enumerate((37, 11)):
        mine = [s.window for s in samples if s.source == j]
        for e in range(len(mine) // n):
            assert sorted(mine[e * n:(e + 1) * n]) == list(range(n))
        assert mine[:n] != mine[n:2 * n]   # each epoch has its own order


def test_rows_are_the_windows_of_their_source():
    seq = 8
    srcs = sources(seq)
    b = BlendedBatches(srcs, [1, 1, 1], ["a", "b", "c"], seq, seed=1)
    samples = b.samples(0, 12)
    ids, labels = b.next_batch(12)
    for s, row, lab in zip(samples, ids.numpy(), labels.numpy()):
        want = srcs[s.source].read(s.window * seq, s.window * seq + seq + 1)
        assert row.tolist() == want[:-1].tolist() and lab.tolist() == want[1:].tolist()


@pytest.mark.parametrize("dp_after", [1, 4])
def test_resume_under_another_dp_size_continues_the_sequence(dp_after):
    """Stop after k steps under dp=2, resume under dp_after: the global batches equal an uninterrupted
    dp=1 run's, with a changing batch size (ramp) too; no sample is repeated or skipped."""
    seq, names, w = 8, ["a", "b", "c"], [0.5, 0.3, 0.2]
    sizes = [4, 4, 8, 8, 8, 12, 12, 16]
    straight = global_rows([BlendedBatches(sources(seq), w, names, seq, seed=5)], sizes)
    before = [BlendedBatches(sources(seq), w, names, seq, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    first = global_rows(before, sizes[:3])
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    after = [BlendedBatches(sources(seq), w, names, seq, seed=5, dp_rank=r, dp_size=dp_after) for r in range(dp_after)]
    for a in after:
        a.load_state_dict(state)
    rest = global_rows(after, sizes[3:])
    for got, want in zip(first + rest, straight):
        np.testing.assert_array_equal(got, want)


def test_resume_refuses_another_blend_or_seed():
    seq = 8
    b = BlendedBatches(sources(seq), [0.5, 0.3, 0.2], ["a", "b", "c"], seq, seed=5)
    b.next_batch(4)
    sd = b.state_dict()
    with pytest.raises(ConfigError, match=r"^train\.seed: .*train\.seed=5"):
        BlendedBatches(sources(seq), [0.5, 0.3, 0.2], ["a", "b", "c"], seq, seed=6).load_state_dict(sd)
    with pytest.raises(ConfigError, match=r"^data\.blend: .*weight 0\.3.*weight 0\.4"):
        BlendedBatches(sources(seq), [0.5, 0.4, 0.2], ["a", "b", "c"], seq, seed=5).load_state_dict(sd)
    with pytest.raises(ConfigError, match=r"^data\.blend: .*text corpus"):
        BlendedBatches(sources(seq), [0.5, 0.3, 0.2], ["a", "b", "c"], seq, seed=5).load_state_dict(
            {"consumed_samples": 4, "seed": 5, "num_samples": 10})


def test_tiny_source_and_weight_fail_with_the_key():
    with pytest.raises(ConfigError, match=r"^data\.blend: source b holds fewer than data\.seq_len\+1=9"):
        BlendedBatches([ArraySource(np.arange(100)), ArraySource(np.arange(5))], [1, 1], ["a", "b"], 8, seed=0)
    with pytest.raises(ConfigError, match=r"^data\.blend: weight 1e-06 of b is below"):
        BlendedBatches(sources(8, (10, 10)), [1, 1e-6], ["a", "b"], 8, seed=0)


def test_val_batches_per_source():
    seq = 8
    val = blend_val_batches(sources(seq, (10, 3)), ["a", "b"], seq, batch_size=4, max_batches=2)
    assert [len(v) for v in val.values()] == [2, 1]
    assert val["a"][1][0][0, 0].item() == 4 * seq and val["b"][0][0].shape == (3, seq)


# ---------------------------------------------------------------------------------------- schedules
def v3_optim() -> OptimConfig:
    """The V3 report's values (../shared/REFERENCE.md §10; configs/schedule/v3.yaml)."""
    return OptimConfig(lr=2.2e-4, warmup_steps=2000, decay="phases", phases=[
        LRPhase(tokens=10e12, lr=2.2e-4), LRPhase(tokens=4.3e12, lr=2.2e-5, shape="cosine"),
        LRPhase(tokens=333e9, lr=2.2e-5), LRPhase(tokens=167e9, lr=7.3e-6)])


def test_v3_lr_phases():
    o = v3_optim()
    lr = lambda step, tokens: o.lr * lr_multiplier(o, 0, step, tokens)  # noqa: E731
    assert lr(0, 0) == pytest.approx(2.2e-4 / 2000) and lr(999, 1e9) == pytest.approx(1.1e-4)
    assert lr(5000, 9.99e12) == pytest.approx(2.2e-4)
    assert lr(10**6, 10e12 + 2.15e12) == pytest.approx((2.2e-4 + 2.2e-5) / 2)       # cosine midpoint
    assert lr(10**6, 14.3e12 - 1) == pytest.approx(2.2e-5, rel=1e-6)
    assert lr(10**6, 14.5e12) == pytest.approx(2.2e-5) and lr(10**6, 14.7e12) == pytest.approx(7.3e-6)
    assert lr(10**6, 20e12) == pytest.approx(7.3e-6)                                   # after the last phase
    lin = OptimConfig(lr=1.0, warmup_steps=0, decay="phases", phases=[LRPhase(tokens=100, lr=0.0, shape="linear")])
    assert phase_lr(lin, 25) == pytest.approx(0.75)


def test_cosine_by_steps_unchanged():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_multiplier(o, 110, 4, 123) == pytest.approx(0.5)
    assert lr_multiplier(o, 110, 60, 0) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_batch_ramp():
    t = TrainConfig(global_batch_size=16, batch_ramp=BatchRamp(start=4, increment=4, tokens=3000))
    assert ramp_sizes(t) == [4, 8, 12, 16]
    assert [batch_size_at(t, x) for x in (0, 999, 1000, 2500, 3000, 10**9)] == [4, 4, 8, 12, 16, 16]
    assert batch_size_at(TrainConfig(global_batch_size=16), 0) == 16
    v3 = TrainConfig(global_batch_size=15360, batch_ramp=BatchRamp(start=3072, tokens=469e9))
    assert ramp_sizes(v3) == [3072, 6144, 9216, 12288, 15360] and batch_size_at(v3, 469e9) == 15360
