"""Cut the single-device model into pipeline stages.

Stage ``s`` of ``n`` runs a contiguous slice of ``model.layers``; stage 0 also owns the embedding and
the last stage the final norm, the output head and the MTP modules (which need the embedding: the last
stage borrows stage 0's embedding module when both live on one rank — DualPipe/DualPipeV put them on
the same rank — or holds a tied copy otherwise, whose gradient the executor sums with stage 0's).
Parameter names inside a stage are the single-device names (``layers.3.attn.wo.weight``), so
checkpoints and gradient checks need no translation. A stage computes nothing itself: it hands its modules
to the model's own forward of a span of layers (``models.transformer.span_steps``).
"""
from __future__ import annotations

import torch
from torch import nn

from models.steps import Steps, drive
from models.transformer import DeepSeekV3, Tail, span_steps

from .schedules import Schedule


def layer_split(n_layers: int, n_stages: int, layout: list[int] | None = None) -> list[range]:
    """Layers of each stage: ``layout`` (counts per stage) or as even as possible, extra layers to the
    middle stages (the ends also carry the embedding, head and MTP)."""
    if layout is not None:
        if len(layout) != n_stages or sum(layout) != n_layers or min(layout) < 0:
            raise ValueError(f"parallel.pp_layout {layout}: need {n_stages} non-negative counts summing to {n_layers}")
        counts = list(layout)
    else:
        base, extra = divmod(n_layers, n_stages)
        order = sorted(range(n_stages), key=lambda s: abs(s - (n_stages - 1) / 2))  # middle stages first
        counts = [base + (s in order[:extra]) for s in range(n_stages)]
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


class Stage(nn.Module):
    def __init__(self, model: DeepSeekV3, stage: int, n_stages: int, layers: range,
                 borrowed_embed: nn.Embedding | None = None):
        super().__init__()
        self.cfg = model.cfg
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layer_ids = list(layers)
        if self.is_first:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if self.is_last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp
            if not self.is_first and model.cfg.mtp_depth:
                if borrowed_embed is not None:
                    self._borrowed = [borrowed_embed]     # a list: not registered, so not owned twice
                else:
                    self.embed = model.embed               # tied copy (gradients summed by the executor)

    @property
    def mtp_embed(self) -> nn.Embedding | None:
        """The embedding the MTP modules read (None without MTP)."""
        if hasattr(self, "embed"):
            return self.embed
        return self._borrowed[0] if hasattr(self, "_borrowed") else None

    def steps(self, x: torch.Tensor | None, input_ids: torch.Tensor, labels: torch.Tensor, mtp_weight: float = 0.0
              ) -> Steps:
        """This stage's span of the model, as steps (cut at the expert all-to-alls). Returns ``(out, parts,
        aux)``: the hidden states for the next stage and None, or (last stage) the loss and ``(lm_loss,
        mtp_loss)``; ``aux`` is the sum of the stage's MoE balance losses (None outside training)."""
        tail = Tail(self.norm, self.head, self.mtp, self.mtp_embed) if self.is_last else None
        return span_steps(self.cfg, input_ids, labels, x, embed=self.embed if self.is_first else None,
                          blocks=self.layers.values(), tail=tail, mtp_weight=mtp_weight)

    def forward(self, x: torch.Tensor | None, input_ids: torch.Tensor, labels: torch.Tensor, mtp_weight: float = 0.0
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``steps`` straight through: ``(out, parts)`` with the parts detached."""
        out, parts, _ = drive(self.steps(x, input_ids, labels, mtp_weight))
        return out, None if parts is None else (parts[0].detach(), parts[1].detach())


def build_stages(model: DeepSeekV3, schedule: Schedule, pp_rank: int,
                 layout: list[int] | None = None) -> dict[int, Stage]:
    """This rank's stage modules, keyed by chunk, placed as ``schedule`` places them. Modules are shared
    with ``model`` (no copies)."""
    n = schedule.n_stages
    split = layer_split(model.cfg.n_layers, n, layout)
    chunks = schedule.stages_of(pp_rank)
    stages = {}
    first_here = 0 in chunks.values()
    for chunk, s in sorted(chunks.items(), key=lambda kv: kv[1]):
        borrowed = model.embed if (s == n - 1 and first_here and s != 0) else None
        stages[chunk] = Stage(model, s, n, split[s], borrowed)
    return stages


def prune_model(model: DeepSeekV3, stages: dict[int, Stage]) -> DeepSeekV3:
    """Drop the modules no local stage uses, so ``model.named_parameters()`` is exactly this rank's
    parameters under their single-device names (optimizer, gradient sync and checkpoints use it)."""
    held = {i for st in stages.values() for i in st.layer_ids}
    for i in range(len(model.layers)):
        if i not in held:
            model.layers[i] = nn.Identity()
    if not any(hasattr(st, "embed") for st in stages.values()):
        model.embed = None
    if not any(st.is_last for st in stages.values()):
        model.norm = model.head = None
        model.mtp = nn.ModuleList()
    return model
