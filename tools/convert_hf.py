"""Convert between Hugging Face DeepseekV3 checkpoints and our model checkpoints.

    python -m tools.convert_hf import <hf_dir> <out_dir>        # config.json + *.safetensors -> ours
    python -m tools.convert_hf export <ckpt_dir> <out_hf_dir>   # ours -> config.json + *.safetensors

Our model checkpoint (the trainer writes the same layout) is a directory holding ``model_config.yaml``
(``dataclasses.asdict(ModelConfig)``) and a ``torch.distributed.checkpoint`` (DCP) checkpoint of
``{"model": model.state_dict()}``; other top-level entries (optimizer state) may sit beside it and are not read.
DCP runs in one process without ``init_process_group``. The weight/config mapping lives in ``models/hf.py``.
Errors (missing directory or files, unsupported config) print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

MODEL_CONFIG = "model_config.yaml"
DTYPES = ("float32", "bfloat16", "float16")
# DCP's notice that, torch.distributed being uninitialised, it saves/loads in one process: the intent here.
_DCP_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def save_model_checkpoint(model, ckpt_dir) -> Path:
    """Write ``model_config.yaml`` + a DCP checkpoint of ``{"model": model.state_dict()}`` to ``ckpt_dir``."""
    import torch.distributed.checkpoint as dcp
    import yaml

    out = Path(ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MODEL_CONFIG).write_text(yaml.safe_dump(dataclasses.asdict(model.cfg), sort_keys=False))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(out))
    return out


def load_model_checkpoint(ckpt_dir, device="cpu"):
    """The ``DeepSeekV3`` stored in ``ckpt_dir`` (built on meta, materialised on ``device``, then DCP-loaded)."""
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
        raise models.ConfigError(f"{src / MODEL_CONFIG}: unknown model keys {unknown}")
    model = models.build(models.ModelConfig(**values), "meta").to_empty(device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS)
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(src))   # fills the tensors in place
    for moe in model.moe_layers():   # non-persistent counters are not in the checkpoint
        moe.tokens_per_expert.zero_()
    return model


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
    args = parser.parse_args(argv)
    src = Path(args.hf_dir if args.command == "import" else args.ckpt_dir)
    try:
        if not src.is_dir():
            raise FileNotFoundError(f"{src}: no such directory")
        import torch

        import models
        if args.command == "import":
            save_model_checkpoint(models.from_hf(src, dtype=getattr(torch, args.dtype)), args.out_dir)
        else:
            model = load_model_checkpoint(src)
            if args.dtype:
                for p in model.parameters():   # the balancing bias stays fp32, as in HF
                    p.data = p.data.to(getattr(torch, args.dtype))
            models.to_hf(model, args.out_hf_dir)
    except (OSError, ValueError) as e:   # ConfigError is a ValueError
        print(f"convert_hf {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
