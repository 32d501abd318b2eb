"""Training data, below the trainer: a corpus tokenized once (``corpus``, ``tokenizer``), Megatron-style token
shards (``shards``), weighted blends of them (``blend``), the batches served from either (``batches``) and the
batch-size ramp (``ramp``). ``tools/prepare_data.py`` writes shards through ``shards.write_shard``.

The public API, used by ``trainer/`` and ``tools/``; everything else is private to this package.
"""
from .batches import PackedBatches, val_batches
from .blend import BadDocument, BlendedBatches, blend_val_batches
from .corpus import Corpus, load_corpus, use_offline_hub
from .ramp import batch_size_at, micro_batches, ramp_sizes
from .shards import TokenSource, open_tokens, token_dtype, write_shard
from .tokenizer import EOS, carried_tokenizer, encode, find_eos_id, load_tokenizer, tokenizer_files, vocab_difference

__all__ = ["PackedBatches", "val_batches", "BadDocument", "BlendedBatches", "blend_val_batches", "Corpus", "load_corpus",
           "use_offline_hub", "batch_size_at", "micro_batches", "ramp_sizes", "TokenSource", "open_tokens", "token_dtype",
           "write_shard", "EOS", "carried_tokenizer", "encode", "find_eos_id", "load_tokenizer", "tokenizer_files",
           "vocab_difference"]
