"""Convert between Hugging Face DeepseekV3 checkpoints and our model checkpoints.

    python -m tools.convert_hf import <hf_dir> <out_dir>        # config.json + *.safetensors -> ours
    python -m tools.convert_hf export <ckpt_dir> <out_hf_dir> [--tokenizer PATH]   # ours -> HF directory

Our model checkpoint (the trainer writes the same layout) is a directory holding ``model_config.yaml``
(``dataclasses.asdict(ModelConfig)``) and a ``torch.distributed.checkpoint`` (DCP) checkpoint of
``{"model": model.state_dict()}``; other top-level entries (optimizer state) may sit beside it and are not read.
DCP runs in one process without ``init_process_group``. The weight/config mapping lives in ``models/hf.py``.

``import`` records the model config exactly as converted (``models.hf.config_from_hf_dir``) and copies the HF
directory's tokenizer files, if any, to ``<out_dir>/tokenizer/``. ``export`` writes the tokenizer given by
``--tokenizer`` (read as the trainer reads ``data.tokenizer``), else the one the checkpoint carries
(``tokenizer/`` or ``tokenizer.json`` in the checkpoint directory or its parent), and takes ``bos/eos/pad`` ids
from it. Both print what they wrote and how to load it. Errors print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import warnings
from pathlib import Path

from errors import ConfigError

MODEL_CONFIG = "model_config.yaml"
DTYPES = ("float32", "bfloat16", "float16")
# DCP's notice that, torch.distributed being uninitialised, it saves/loads in one process: the intent here.
_DCP_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def save_model_checkpoint(model, ckpt_dir) -> Path:
    """Write ``model_config.yaml`` + a DCP checkpoint of ``{"model": model.state_dict()}`` to ``ckpt_dir``, and its
    manifest last (what ``checkpoint.init_from`` and ``checkpoint.resume`` verify)."""
    import torch.distributed.checkpoint as dcp
    import yaml

    from checkpoint import write_manifest

    out = Path(ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MODEL_CONFIG).write_text(yaml.safe_dump(dataclasses.asdict(model.cfg), sort_keys=False))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(out))
    write_manifest(out, 0)
    return out


def load_model_checkpoint(ckpt_dir, device="cpu", ema: bool = False):
    """The ``DeepSeekV3`` stored in ``ckpt_dir`` (built on meta, materialised on ``device``, then DCP-loaded).
    ``ema``: its parameters from the checkpoint's EMA (``train.ema_decay``; buffers such as the balancing
    biases from the model)."""
    import torch.distributed.checkpoint as dcp
    import yaml

    import models

    src = Path(ckpt_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such directory")
    if not (src / MODEL_CONFIG).is_file():
        raise FileNotFoundError(f"{src}: no {MODEL_CONFIG} (not a model checkpoint directory)")
    values = yaml.safe_load((src / MODEL_CONFIG).read_text()) or {}
    known = {f.name for f in dataclasses.fields(models.ModelConfig)}
    if unknown := sorted(set(values) - known):
        raise ConfigError(f"{src / MODEL_CONFIG}: unknown model keys {unknown}")
    model = models.build(models.ModelConfig(**values), "meta").to_empty(device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS)
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(src))   # fills the tensors in place
        if ema:
            from checkpoint import has_state
            if not has_state(src, "ema"):
                raise ConfigError(f"--ema: {src} holds no EMA (it was trained without train.ema_decay)")
            params = {n: p.detach() for n, p in model.named_parameters()}
            dcp.load({"ema": params}, checkpoint_id=str(src))   # fp32 EMA copied into the parameters' dtype
    for moe in model.moe_layers():   # non-persistent counters are not in the checkpoint
        moe.tokens_per_expert.zero_()
    return model


def load_tokenizer(path):
    """A HF tokenizer directory or tokenizer.json, loaded as the trainer loads ``data.tokenizer``, with
    ``eos_token`` set to the end-of-text token the trainer finds in it (data/tokenizer.py)."""
    from data.tokenizer import find_eos_id, load_tokenizer

    try:
        tok, _ = load_tokenizer(str(path))
        find_eos_id(tok, str(path))
    except ConfigError as e:   # its messages name the trainer's key; here the flag is --tokenizer
        raise ConfigError(str(e).replace("data.tokenizer", "--tokenizer", 1)) from None
    return tok


def carried_tokenizer(ckpt_dir) -> Path | None:
    """The tokenizer a checkpoint carries (``data.carried_tokenizer``: the trainer's step dir holds the tokenizer's
    files, ``import`` writes ``tokenizer/``, older step dirs a bare ``tokenizer.json``), or its parent's."""
    from data.tokenizer import carried_tokenizer as carried

    src = Path(ckpt_dir)
    return carried(src) or carried(src.parent)


def _copy_tokenizer_files(hf_dir: Path, out: Path) -> list[str]:
    from data.tokenizer import TOKENIZER_FILES

    names = [n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]
    if names:
        (out / "tokenizer").mkdir(exist_ok=True)
        for n in names:
            shutil.copyfile(hf_dir / n, out / "tokenizer" / n)
    return names


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def run_import(src: Path, out: Path, dtype: str) -> None:
    import torch

    from models import hf

    cfg = hf.config_from_hf_dir(src)
    model = hf.empty_model(cfg, getattr(torch, dtype))
    stats = hf.load_hf_into(model, src, strict=True)
    save_model_checkpoint(model, out)
    tok = _copy_tokenizer_files(src, out)
    n = sum(p.numel() for p in model.parameters())
    fp8 = f", {stats['dequantized']} FP8 tensors dequantised" if stats["dequantized"] else ""
    print(f"convert_hf import: read {stats['tensors']} tensors ({_mb(stats['bytes'])}) from {stats['files']} files in "
          f"{src}{fp8}; wrote {out}: {MODEL_CONFIG} + DCP checkpoint of {n:,} {dtype} parameters"
          + (f", tokenizer/ ({', '.join(tok)})" if tok else " (no tokenizer files in the HF directory)"))
    declared = json.loads((src / "config.json").read_text()).get("num_nextn_predict_layers") or 0
    if declared != cfg.mtp_depth:
        print(f"convert_hf import: note: config.json says num_nextn_predict_layers={declared} but the directory "
              f"holds no MTP weights; recorded model.mtp_depth={cfg.mtp_depth}")
    print(f"load it: tools.convert_hf.load_model_checkpoint('{out}'), or train from it with "
          f"checkpoint.init_from={out} (its model config: {out / MODEL_CONFIG})")


def run_export(src: Path, out: Path, dtype: str | None, tokenizer: str | None, ema: bool = False) -> None:
    import torch

    import models

    tok_path = Path(tokenizer) if tokenizer else carried_tokenizer(src)
    tok = load_tokenizer(tok_path) if tok_path else None
    model = load_model_checkpoint(src, ema=ema)
    if dtype:
        for p in model.parameters():   # the balancing bias stays fp32, as in HF
            p.data = p.data.to(getattr(torch, dtype))
    models.to_hf(model, out, tokenizer=tok)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"convert_hf export: wrote {out}: {', '.join(files)} ({_mb(weights)} of "
          f"{str(model.embed.weight.dtype).removeprefix('torch.')} weights)")
    if tok is None:
        print("convert_hf export: no tokenizer (pass --tokenizer PATH): config.json names no bos/eos/pad ids, "
              "so generate() will not stop at end of text, and AutoTokenizer cannot load the directory")
    else:
        print(f"convert_hf export: tokenizer from {tok_path}: eos {tok.eos_token!r} = {tok.eos_token_id}, bos "
              f"{tok.bos_token_id}, pad {tok.pad_token_id} (generation pads with "
              f"{tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id})")
    print(f"load it: AutoModelForCausalLM.from_pretrained('{out}')"
          + (f" and AutoTokenizer.from_pretrained('{out}')" if tok is not None else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.convert_hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF checkpoint dir -> our model checkpoint dir")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter dtype (default: float32)")
    exp = sub.add_parser("export", help="our model checkpoint dir -> HF checkpoint dir")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_hf_dir")
    exp.add_argument("--dtype", choices=DTYPES, default=None,
                     help="cast parameters before writing (default: float32, as loaded)")
    exp.add_argument("--ema", action="store_true", help="export the parameter EMA (train.ema_decay) instead of the weights")
    exp.add_argument("--tokenizer", default=None,
                     help="HF tokenizer dir or tokenizer.json to write beside the weights (default: the one the "
                          "checkpoint carries, if any)")
    args = parser.parse_args(argv)
    src = Path(args.hf_dir if args.command == "import" else args.ckpt_dir)
    try:
        if not src.is_dir():
            raise FileNotFoundError(f"{src}: no such directory")
        if args.command == "import":
            run_import(src, Path(args.out_dir), args.dtype)
        else:
            run_export(src, Path(args.out_hf_dir), args.dtype, args.tokenizer, args.ema)
    except (OSError, ValueError) as e:   # ConfigError is a ValueError
        print(f"convert_hf {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
