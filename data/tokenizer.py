"""The corpus tokenizer: ``data.tokenizer`` (a local HF tokenizer directory or a tokenizer.json file) or a
byte-level BPE trained on the training documents (``data.corpus`` caches it); its EOS id; batch encoding; the
tokenizer a model directory carries and the files a checkpoint keeps of it; whether two tokenizers give the same
ids."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from errors import ConfigError

EOS = "<|endoftext|>"
# The files of a HF tokenizer directory (a model directory holds them beside its weights and configs): what travels
# with token datasets and imported checkpoints, and what a directory's tokenizer identity hashes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model")
_EOS_CANDIDATES = (EOS, "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")


def wrap_tokenizer(tok_file: str):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=tok_file, eos_token=EOS, clean_up_tokenization_spaces=False)


def train_bpe(doc_batches, vocab_size: int) -> str:
    """A byte-level BPE with ``EOS`` as its special token, trained on ``doc_batches`` (lists of documents);
    -> its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(doc_batches, trainer=trainer)
    return tok.to_str()


def load_tokenizer(path: str):
    """-> (tokenizer, identity hash) for a local HF tokenizer dir or a tokenizer.json file."""
    p = Path(os.path.expanduser(path))
    if not p.exists():
        raise ConfigError(f"data.tokenizer: {path} does not exist (use a local HF tokenizer directory or a "
                          f"tokenizer.json file, or leave it unset to train a BPE on the corpus)")
    h = hashlib.sha256()   # identity = bytes of its tokenizer files (else of every small file; stats of big ones)
    files = [f for f in (sorted(p.iterdir()) if p.is_dir() else [p]) if f.is_file()]
    files = [f for f in files if f.name in TOKENIZER_FILES] or files   # a model dir, a step dir: not the weights
    for f in files:
        st = f.stat()
        h.update(f.name.encode() + (f.read_bytes() if st.st_size < 64 << 20 else b"%d %d" % (st.st_size, st.st_mtime_ns)))
    try:
        if p.is_dir():
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        else:
            from transformers import PreTrainedTokenizerFast
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p), clean_up_tokenization_spaces=False)
    except Exception as e:  # noqa: BLE001 - report any loader failure against the key
        raise ConfigError(f"data.tokenizer: cannot load {path}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from e
    return tok, h.hexdigest()


def find_eos_id(tok, name) -> int:
    """The tokenizer's EOS id; a bare tokenizer.json gets its eos_token set from well-known names."""
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    found = [c for c in _EOS_CANDIDATES if c in tok.get_vocab()]
    if found:
        tok.eos_token = found[0]
        return int(tok.convert_tokens_to_ids(found[0]))
    if getattr(tok, "sep_token_id", None) is not None:  # BERT-style tokenizers
        return int(tok.sep_token_id)
    raise ConfigError(f"data.tokenizer: {name} defines no EOS token (tried eos_token, {', '.join(_EOS_CANDIDATES)})")


def encode(tok, texts):
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def carried_tokenizer(path) -> Path | None:
    """The tokenizer a model directory carries, or None: the directory itself when it holds
    ``tokenizer_config.json`` (a Hugging Face model directory, our step dir), else its ``tokenizer/``
    (``tools.convert_hf import``, ``tools.prepare_data`` output), else its bare ``tokenizer.json``."""
    p = Path(os.path.expanduser(str(path)))
    for candidate in (p / "tokenizer_config.json", p / "tokenizer", p / "tokenizer.json"):
        if candidate.exists():
            return p if candidate.name == "tokenizer_config.json" else candidate
    return None


def tokenizer_files(tok) -> dict[str, bytes]:
    """The files ``tok.save_pretrained`` writes (tokenizer.json, tokenizer_config.json with bos / eos / pad and the
    special tokens, the chat template when there is one), by name: what a checkpoint carries."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return {f.name: f.read_bytes() for f in sorted(Path(d).iterdir()) if f.is_file()}


def vocab_difference(a, b) -> str | None:
    """None when the tokenizers ``a`` and ``b`` give every token the same id and have the same EOS id (the ids a
    model is trained on mean the same), else what differs first: the sizes, a token's id, the EOS id."""
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        return f"{len(va)} vs {len(vb)} tokens"
    ids_b = {i: t for t, i in vb.items()}
    for token, i in sorted(va.items(), key=lambda kv: kv[1]):
        if ids_b.get(i) != token:
            return f"id {i} is {token!r} vs {ids_b.get(i)!r}"
    ea, eb = find_eos_id(a, "tokenizer"), find_eos_id(b, "tokenizer")
    return None if ea == eb else f"eos id {ea} vs {eb}"
