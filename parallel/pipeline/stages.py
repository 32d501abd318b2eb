"""Cut the single-device model into pipeline stages.

Stage ``s`` of ``n`` runs a contiguous slice of ``model.layers``; stage 0 also owns the embedding and
the last stage the final norm, the output head and the MTP modules (which need the embedding: the last
stage borrows stage 0's embedding module when both live on one rank — DualPipe/DualPipeV put them on
the same rank — or holds a tied copy otherwise, whose gradient the executor sums with stage 0's).
Parameter names inside a stage are the single-device names (``layers.3.attn.wo.weight``), so
checkpoints and gradient checks need no translation.
"""
from __future__ import annotations

import torch
from torch import nn

from models.layers import rope_cos_sin
from models.moe import MoE
from models.transformer import DeepSeekV3, head_loss, moe_aux_loss

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
    def mtp_embed(self) -> nn.Embedding:
        return self.embed if hasattr(self, "embed") else self._borrowed[0]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, mtp_weight: float = 0.0
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Hidden states for the next stage, or (on the last stage) the loss. Returns ``(out, parts)``
        with ``parts = (lm_loss, mtp_loss)`` on the last stage, else None."""
        h = self.embed(input_ids) if self.is_first else x
        rope = rope_cos_sin(self.cfg, input_ids.shape[1], input_ids.device)
        for layer in self.layers.values():
            h = layer(h, rope)
        if not self.is_last:
            return h, None
        loss, lm, mtp = head_loss(h, input_ids, labels, mtp_weight, cfg=self.cfg, norm=self.norm, head=self.head,
                                  embed=self.mtp_embed, mtp=self.mtp)
        return loss, (lm.detach(), mtp.detach())

    def aux_loss(self, aux_alpha: float) -> torch.Tensor | None:
        """This stage's sequence-wise balance losses from its last forward (MTP blocks included)."""
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        if not moes or not aux_alpha:
            return None
        return moe_aux_loss(moes, aux_alpha)


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
