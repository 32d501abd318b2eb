"""The DeepSeek-V3 model: embedding -> blocks (dense FFN first, then MoE) -> norm -> head, plus MTP.

Single-device PyTorch: no process groups here. Parallel layouts transform a built model (``parallel/``).
Shape legend: B batch, T sequence, D hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MLA
from .config import ModelConfig
from .layers import MLP, RMSNorm, rope_cos_sin
from .moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.is_moe_layer(layer_id) else MLP(cfg.dim, cfg.inter_dim)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), rope)
        return x_BTD + self.ffn(self.ffn_norm(x_BTD))


class MTPModule(nn.Module):
    """Multi-token prediction module k: ``h_k = Block(W [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1,i})])``.

    Embedding and output head are the main model's (shared); ``norm`` is this module's final norm.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, layer_id)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, rope) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        return self.block(x, rope)


@dataclass
class LossOutput:
    loss: torch.Tensor        # the objective: lm + mtp_weight * mtp + aux_alpha * aux (has grad)
    lm_loss: torch.Tensor     # next-token cross-entropy (detached)
    mtp_loss: torch.Tensor    # mean cross-entropy over the D MTP depths, unweighted (detached; 0 if D=0)
    aux_loss: torch.Tensor    # aux_alpha * sum of the layers' sequence-wise balance losses (detached)


class DeepSeekV3(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth))

    # ---- forward paths -------------------------------------------------------------------------
    def hidden(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Final residual stream of the main model (before the final norm)."""
        rope = rope_cos_sin(self.cfg, input_ids_BT.shape[1], input_ids_BT.device)
        h = self.embed(input_ids_BT)
        for layer in self.layers:
            h = layer(h, rope)
        return h

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of the main head (MTP modules are not run)."""
        return self.head(self.norm(self.hidden(input_ids_BT)))

    def compute_loss(self, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor,
                     mtp_weight: float = 0.0, aux_alpha: float = 0.0) -> LossOutput:
        """Training objective. ``labels[:, i]`` is the token after ``input_ids[:, i]``."""
        h = self.hidden(input_ids_BT)
        loss, lm_loss, mtp_loss = head_loss(h, input_ids_BT, labels_BT, mtp_weight, cfg=self.cfg, norm=self.norm,
                                            head=self.head, embed=self.embed, mtp=self.mtp)
        aux_loss = moe_aux_loss(self.moe_layers(), aux_alpha) if self.training else lm_loss.new_zeros(())
        if aux_alpha and self.training:
            loss = loss + aux_loss
        return LossOutput(loss, lm_loss.detach(), mtp_loss.detach(), aux_loss.detach())

    # ---- MoE helpers -----------------------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        """Every MoE layer in forward order: main blocks, then MTP blocks."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    # ---- initialisation --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter/buffer; call after ``to_empty`` when the model was built on meta."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, (RMSNorm, MoE)):
                module.init_weights() if isinstance(module, RMSNorm) else module.init_weights(std)


def _ce(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten())


def head_loss(h_BTD: torch.Tensor, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor, mtp_weight: float, *,
              cfg: ModelConfig, norm: nn.Module, head: nn.Module, embed: nn.Module, mtp: nn.ModuleList
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LM loss from the main model's final residual stream, plus the MTP modules' losses.

    MTP depth k uses positions ``i < T-k``: it sees ``Emb(input_ids[:, i+k])`` and predicts
    ``labels[:, i+k]`` (the token k+1 steps ahead of position i). Returns ``(lm + mtp_weight * mtp,
    lm, mtp)`` where ``mtp`` is the mean cross-entropy over the depths (0 without MTP). Shared by the
    whole model and by the last pipeline stage.
    """
    lm_loss = _ce(head(norm(h_BTD)), labels_BT)
    T = input_ids_BT.shape[1]
    mtp_losses = []
    h = h_BTD
    for k, module in enumerate(mtp, start=1):
        if T - k <= 0:
            break
        rope = rope_cos_sin(cfg, T - k, h.device)
        h = module(h[:, :T - k], embed(input_ids_BT[:, k:]), rope)
        mtp_losses.append(_ce(head(module.norm(h)), labels_BT[:, k:]))
    if not mtp_losses:
        return lm_loss, lm_loss, lm_loss.new_zeros(())
    mtp_loss = torch.stack(mtp_losses).mean()
    return lm_loss + mtp_weight * mtp_loss, lm_loss, mtp_loss


def moe_aux_loss(moe_layers: list[MoE], aux_alpha: float) -> torch.Tensor | float:
    """``aux_alpha`` x the sum of the layers' sequence-wise balance losses from their last forward."""
    aux = [m.aux_loss for m in moe_layers if m.aux_loss is not None]
    return aux_alpha * torch.stack(aux).sum() if aux else torch.zeros(())


def build(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = 0) -> DeepSeekV3:
    """Build the model on ``device``. ``"meta"`` builds shapes only (no memory, no init).

    The weights are drawn on the CPU and then moved, so a seed gives the same model on every device
    (a GPU run starts from exactly the weights of the CPU run it is compared with)."""
    cfg.validate()
    with torch.device("meta"):
        model = DeepSeekV3(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device="cpu")
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model.to(device)
