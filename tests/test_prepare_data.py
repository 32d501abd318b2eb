"""tools/prepare_data.py: text corpora -> token shards; deterministic, resumable, one tokenizer per output."""
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tools.prepare_data import KILL_AFTER_ENV, main
from data.shards import open_tokens, verify

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu naïve café — ✓ 日本".split()


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 30))) + ("." if i % 3 else "\nsecond line") for i in range(n)]


def _bpe(path, texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four inputs of every kind, the texts they hold in order (empty documents dropped) and two tokenizers."""
    import datasets
    d = tmp_path_factory.mktemp("corpus")
    a, b, c, e = _texts(23, 1), _texts(17, 2), [t.replace("\n", " ") for t in _texts(9, 3)], _texts(11, 4)
    with open(d / "a.jsonl", "w") as f:
        for t in a[:5] + ["", "   "] + a[5:]:                       # empty documents are dropped
            f.write(json.dumps({"text": t}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in b)
    (d / "c.txt").write_text("\n\n".join(c))                       # .txt: documents split at blank lines
    datasets.Dataset.from_dict({"text": e}).save_to_disk(str(d / "saved"))
    datasets.Dataset.from_dict({"text": a[:4], "id": list(range(4))}).to_parquet(str(d / "p.parquet"))
    _bpe(d / "tok.json", a + b + c + e, 300)
    _bpe(d / "other.json", a + b, 280)
    inputs = [str(d / "a.jsonl"), str(d / "b.jsonl.gz"), str(d / "c.txt"), str(d / "saved"), str(d / "p.parquet")]
    return {"dir": d, "inputs": inputs, "texts": a + b + c + e + a[:4], "tok": str(d / "tok.json"),
            "other": str(d / "other.json")}


def _args(corpus, out, *extra, docs_per_shard=10, workers=1):
    return ["--input", *corpus["inputs"], "--output", str(out), "--tokenizer", corpus["tok"], "--no-progress",
            "--docs-per-shard", str(docs_per_shard), "--workers", str(workers), *extra]


def _files(out) -> dict:
    """Every file of a prepared dataset (not the datasets cache), by relative path."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*"))
            if p.is_file() and ".cache" not in p.parts}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "ds"
    assert main(_args(corpus, out)) == 0
    return out


def test_documents_decode_to_the_inputs(corpus, reference):
    from tokenizers import Tokenizer
    src = open_tokens(reference)
    tok = Tokenizer.from_file(str(reference / "tokenizer" / "tokenizer.json"))
    assert src.tokenizer_hash == hashlib.sha256((reference / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    assert (reference / "tokenizer" / "tokenizer.json").read_bytes() == Path(corpus["tok"]).read_bytes()
    assert (src.vocab_size, src.eos_id, src.dtype) == (300, tok.token_to_id("<|endoftext|>"), np.uint16)
    assert src.num_docs == len(corpus["texts"])
    for i, text in enumerate(corpus["texts"]):
        doc = src.document(i)
        assert doc[-1] == src.eos_id and src.eos_id not in doc[:-1]
        assert tok.decode(doc[:-1].tolist()) == text
    manifest = json.loads((reference / "manifest.json").read_text())
    assert len(manifest["shards"]) == 7 and src.num_tokens == manifest["num_tokens"]   # 66 rows / 10
    assert verify(reference) == []
    assert not (reference / ".cache").exists() and not list(reference.glob(".*.tmp"))


def test_worker_count_does_not_change_the_output(corpus, reference, tmp_path):
    assert main(_args(corpus, tmp_path / "w2", workers=2)) == 0
    assert _files(tmp_path / "w2") == _files(reference)


def test_rerun_is_a_no_op_and_damage_is_redone(corpus, reference, tmp_path, capsys):
    out = tmp_path / "ds"
    (out / "tokenizer").mkdir(parents=True)       # left by a run of something else, killed before any record
    (out / "tokenizer" / "merges.txt").write_text("x")
    (out / "shard-00000.bin").write_bytes(b"junk")
    (out / "shard-00042.idx").write_bytes(b"junk")
    assert main(_args(corpus, out)) == 0
    assert _files(out) == _files(reference)
    capsys.readouterr()
    assert main(_args(corpus, out)) == 0
    assert "(7 reused)" in capsys.readouterr().out
    os.truncate(out / "shard-00003.bin", 10)        # a damaged shard, a lost done-record, a temp file
    os.unlink(out / "shard-00005.done.json")
    (out / ".shard-00006.bin.x1y2.tmp").write_bytes(b"half")
    assert main(_args(corpus, out)) == 0
    assert "(5 reused)" in capsys.readouterr().out
    assert _files(out) == _files(reference)


def test_refuses_another_tokenizer(corpus, reference, tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(_args(corpus, out)) == 0
    capsys.readouterr()
    other = _args(corpus, out)
    other[other.index("--tokenizer") + 1] = corpus["other"]
    for drop_manifest in (False, True):             # a finished output, then one holding only done-records
        if drop_manifest:
            os.unlink(out / "manifest.json")
        assert main(other) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "tok.json" in err and "other.json" in err
        assert "another --output" in err and str(out) in err
    assert main(_args(corpus, out, docs_per_shard=5)) == 2
    assert "docs_per_shard=10, this run has docs_per_shard=5" in capsys.readouterr().err


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "tools.prepare_data", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, **kw)


def test_cli_killed_after_two_shards_then_resumed(corpus, reference, tmp_path):
    """The test hook SIGKILLs the run after 2 recorded shards (the other worker may be mid-shard); the re-run,
    through ``python -m``, ends byte-identical to the uninterrupted run."""
    out = tmp_path / "ds"
    r = _run(_args(corpus, out, workers=2), env={**os.environ, KILL_AFTER_ENV: "2"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not (out / "manifest.json").exists() and len(list(out.glob("*.done.json"))) >= 2
    r = _run(_args(corpus, out, workers=2))
    assert r.returncode == 0, r.stderr
    assert "prepare_data: 64 documents" in r.stdout and "reused" in r.stdout
    assert _files(out) == _files(reference)


def _gone(pid) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] in "ZX"
    except OSError:
        return True


def test_sigkill_midway_then_resume(tmp_path):
    """A real SIGKILL of the main process once the first shard is recorded: its workers die with it, and the
    re-run's output equals an uninterrupted run's."""
    texts = _texts(3000, 5)
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    _bpe(tmp_path / "tok.json", texts[:500], 300)
    args = ["--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok.json"), "--no-progress",
            "--docs-per-shard", "10"]
    assert main([*args, "--output", str(tmp_path / "ref"), "--workers", "1"]) == 0
    out = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-m", "tools.prepare_data", *args, "--output", str(out), "--workers", "2"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 90
    while not (out / "shard-00000.done.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    workers = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    proc.kill()
    proc.wait()
    assert len(workers) == 2
    assert not (out / "manifest.json").exists(), "the run finished before the kill; make the corpus bigger"
    deadline = time.time() + 10
    while not all(_gone(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert all(_gone(w) for w in workers), "workers outlived the killed run"
    assert main([*args, "--output", str(out), "--workers", "2"]) == 0
    assert _files(out) == _files(tmp_path / "ref")


def test_input_errors(corpus, tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o"), "--tokenizer",
                 corpus["tok"]]) == 2
    assert "--input: " in capsys.readouterr().err
    assert main(["--input", corpus["inputs"][0], "--output", str(tmp_path / "o")]) == 2
    assert "--tokenizer: required" in capsys.readouterr().err
    assert main(["--input", str(corpus["dir"]), "--output", str(tmp_path / "o"), "--tokenizer", corpus["tok"]]) == 2
    assert "b.jsonl.gz" in (err := capsys.readouterr().err) and "glob" in err
