"""The DeepSeek-V3 model: embedding -> blocks (dense FFN first, then MoE) -> norm -> head, plus MTP.

Single-device PyTorch: no process groups here. Parallel layouts transform a built model (``parallel/``).
The forward of a MoE block, of an MTP module and of the loss is written once, as steps that stop at the
dispatcher's boundaries (``models/steps.py``): ``forward`` / ``compute_loss`` drive them straight through,
a pipeline stage drives its part of the model (``span_steps``) piecewise.
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
from .moe import MoE, update_biases
from .steps import Steps, carrying, drive


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.is_moe_layer(layer_id) else MLP(cfg.dim, cfg.inter_dim)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if isinstance(self.ffn, MoE):
            return drive(self.steps(x_BTD, rope))[0]
        h, u = self.ffn_norm.residual(x_BTD, self.attention(x_BTD, rope))
        return h + self.ffn(u)

    def attention(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The attention's output, which the residual stream adds (with the FFN norm after it:
        ``RMSNorm.residual``)."""
        return self.attn(self.attn_norm(x_BTD), rope)

    def steps(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              aux: torch.Tensor | None = None) -> Steps:
        """The block as steps. ``aux``: the balance losses so far; returns ``(out, aux + this block's)``.
        A dense block has no cut and runs as one ``forward`` call."""
        if not isinstance(self.ffn, MoE):
            return self(x_BTD, rope), aux
        h, u = self.ffn_norm.residual(x_BTD, self.attention(x_BTD, rope))
        (y, own), (h, aux) = yield from carrying(self.ffn.steps(u), (h, aux))
        return h + y, _add(aux, own)


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
        return drive(self.steps(h_BTD, emb_BTD, rope))[0]

    def steps(self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, rope, aux: torch.Tensor | None = None) -> Steps:
        """As ``Block.steps``: returns ``(h_k, aux + the block's balance loss)``."""
        x = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        return (yield from self.block.steps(x, rope, aux))


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


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
        return drive(span_steps(self.cfg, input_ids_BT, embed=self.embed, blocks=self.layers))[0]

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of the main head (MTP modules are not run)."""
        return self.head(self.norm(self.hidden(input_ids_BT)))

    def compute_loss(self, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor,
                     mtp_weight: float = 0.0, aux_alpha: float = 0.0) -> LossOutput:
        """Training objective. ``labels[:, i]`` is the token after ``input_ids[:, i]``."""
        loss, (lm_loss, mtp_loss), aux = drive(span_steps(
            self.cfg, input_ids_BT, labels_BT, embed=self.embed, blocks=self.layers, mtp_weight=mtp_weight,
            tail=Tail(self.norm, self.head, self.mtp, self.embed)))
        aux_loss = aux_alpha * aux if aux is not None else lm_loss.new_zeros(())
        if aux_alpha and aux is not None:
            loss = loss + aux_loss
        return LossOutput(loss, lm_loss.detach(), mtp_loss.detach(), aux_loss.detach())

    # ---- MoE helpers -----------------------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        """Every MoE layer in forward order: main blocks, then MTP blocks."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def update_expert_bias(self, gamma: float, load_LE: torch.Tensor | None = None) -> None:
        """Aux-loss-free bias update of every MoE layer (``update_biases``) from its load since the last update:
        ``load_LE``, one row per layer of ``moe_layers`` (the trainer's sum over the data-parallel ranks), or this
        device's own counts. The counters then restart."""
        moes = self.moe_layers()
        if moes:
            update_biases(moes, self.expert_loads() if load_LE is None else load_LE, gamma)
            torch._foreach_zero_([m.tokens_per_expert for m in moes])

    def expert_loads(self) -> torch.Tensor:
        """This device's routed copies per expert since the last bias update, ``[MoE layers, E]`` (a copy)."""
        return torch.stack([m.tokens_per_expert for m in self.moe_layers()])

    # ---- initialisation --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter/buffer; call after ``to_empty`` when the model was built on meta."""
        std = self.cfg.init_std
        owned = (MLP, MLA)   # they draw their own linears (stacked weights as the separate ones were drawn)
        skip = {id(m) for o in self.modules() if isinstance(o, owned) for m in o.children() if isinstance(m, nn.Linear)}
        for module in self.modules():
            if isinstance(module, owned):
                module.init_weights(std)
            elif isinstance(module, nn.Linear) and id(module) not in skip:
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, (RMSNorm, MoE)):
                module.init_weights() if isinstance(module, RMSNorm) else module.init_weights(std)


def _ce(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten())


def head_ce(head: nn.Module, x_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``head(x)``: a head with its own ``cross_entropy(x, labels)`` (``train.head_loss``:
    ``models.loss.ChunkedLossHead``, ``parallel.head_loss.FusedLossHead``) through it, any other head through its
    forward and ``_ce``."""
    own = getattr(head, "cross_entropy", None)
    if own is not None:
        return own(x_BTD, labels_BT)
    return _ce(head(x_BTD), labels_BT)


@dataclass
class Tail:
    """The loss end of the model: final norm, output head, MTP modules and the embedding MTP reads (the
    main model's; a pipeline's last stage may hold a tied copy or borrow the first stage's; None without MTP)."""
    norm: nn.Module
    head: nn.Module
    mtp: nn.ModuleList
    embed: nn.Module | None


def span_steps(cfg: ModelConfig, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor | None = None,
               x_BTD: torch.Tensor | None = None, *, embed: nn.Module | None = None, blocks=(),
               tail: Tail | None = None, mtp_weight: float = 0.0) -> Steps:
    """A contiguous part of the model as steps: the embedding of ``input_ids`` (``embed``) or the hidden
    states ``x``, then ``blocks``, then with ``tail`` the loss (``head_loss_steps``). The whole model is
    one span; a pipeline stage is another. Returns ``(out, parts, aux)``: the hidden states and None, or
    the loss and ``(lm, mtp)``; ``aux`` is the sum of the blocks' balance losses (None outside training).
    A span with the embedding and MTP modules that read the same table hands them its embeddings (carried over the
    cuts) instead of a second lookup: one embedding backward, no sum of two vocabulary-sized gradients."""
    h = embed(input_ids_BT) if embed is not None else x_BTD
    emb = h if embed is not None and tail is not None and len(tail.mtp) and tail.embed is embed else None
    rope = rope_cos_sin(cfg, input_ids_BT.shape[1], input_ids_BT.device)
    aux = None
    for block in blocks:
        (h, aux), (emb,) = yield from carrying(block.steps(h, rope, aux), (emb,))
    if tail is None:
        return h, None, aux
    loss, lm_loss, mtp_loss, aux = yield from head_loss_steps(h, input_ids_BT, labels_BT, mtp_weight, aux,
                                                              cfg=cfg, tail=tail, emb_BTD=emb)
    return loss, (lm_loss, mtp_loss), aux


def head_loss_steps(h_BTD: torch.Tensor, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor, mtp_weight: float,
                    aux: torch.Tensor | None = None, *, cfg: ModelConfig, tail: Tail,
                    emb_BTD: torch.Tensor | None = None) -> Steps:
    """LM loss from the main model's final residual stream, plus the MTP modules' losses, as steps.

    MTP depth k uses positions ``i < T-k``: it sees ``Emb(input_ids[:, i+k])`` (``emb_BTD[:, k:]`` when given:
    ``tail.embed(input_ids)``, already looked up) and predicts ``labels[:, i+k]`` (the token k+1 steps ahead of
    position i). Returns ``(lm + mtp_weight * mtp, lm, mtp, aux)`` where ``mtp`` is the mean cross-entropy over
    the depths (0 without MTP) and ``aux`` has the MTP blocks' balance losses added.
    """
    lm_loss = head_ce(tail.head, tail.norm(h_BTD), labels_BT)
    T = input_ids_BT.shape[1]
    mtp_losses: list[torch.Tensor] = []
    h = h_BTD
    for k, module in enumerate(tail.mtp, start=1):
        if T - k <= 0:
            break
        rope = rope_cos_sin(cfg, T - k, h.device)
        emb_k = emb_BTD[:, k:] if emb_BTD is not None else tail.embed(input_ids_BT[:, k:])
        module_steps = module.steps(h[:, :T - k], emb_k, rope, aux)
        (h, aux), (lm_loss, emb_BTD, *mtp_losses) = yield from carrying(module_steps, (lm_loss, emb_BTD, *mtp_losses))
        mtp_losses.append(head_ce(tail.head, module.norm(h), labels_BT[:, k:]))
    if not mtp_losses:
        return lm_loss, lm_loss, lm_loss.new_zeros(()), aux
    mtp_loss = torch.stack(mtp_losses).mean()
    return lm_loss + mtp_weight * mtp_loss, lm_loss, mtp_loss, aux


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
