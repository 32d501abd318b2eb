"""tools.size: per-rank memory of planned layouts (hand-checked), FLOPs per token and activation estimates
checked against measurements on the tiny model, layout errors."""
import pytest
import torch
from hydra import compose, initialize_config_module

import models
from configs import model_preset
from configs.schema import register, to_object
from errors import ConfigError
from models.params import flops_per_token
from tools.size import main
from trainer.activations import activation_bytes_per_token
from trainer.memory_plan import plan_memory

from .test_recompute import saved_bytes

V3_LAYOUT = ["model=v3_671b", "parallel.pp=16", "parallel.schedule=dualpipe", "parallel.ep=64",
             "parallel.ranks_per_node=8", "parallel.zero=1", "data.seq_len=4096", "train.micro_batch_size=1",
             "train.global_batch_size=15360"]


def compose_cfg(*overrides):
    register()
    with initialize_config_module("configs", version_base=None):
        return to_object(compose("config", overrides=list(overrides)))


def v3_rank0_params_by_hand() -> tuple[int, int]:
    """DeepSeek-V3 671B, PP16 DualPipe, EP64: (dense, expert) parameters on pipeline rank 0.

    61 layers over 16 stages: 3 each, plus one extra for the 13 stages nearest the middle, so stage 0 is
    layers 0-2 (all dense, first_k_dense = 3) and stage 15 is layers 58-60 (MoE). DualPipe puts stages 0
    and 15 on rank 0: embedding + 3 dense layers + 3 MoE layers + final norm + head + the MTP module.
    """
    D, H, V = 7168, 128, 129280
    q_lora, kv_lora, nope, rope, v = 1536, 512, 128, 64, 128
    attn = (D * q_lora + q_lora + q_lora * H * (nope + rope)      # wqkv_a (query rows), q_norm, wq_b
            + D * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v)  # wqkv_a (kv rows), kv_norm, wkv_b
            + H * v * D)                                          # wo
    norms = 2 * D
    dense_ffn = 3 * D * 18432
    E, F, ep = 256, 2048, 64
    moe_dense = E * D + 3 * D * F                                 # router + 1 shared expert
    moe_expert = E * 3 * D * F // ep                              # 4 of the 256 routed experts
    dense = V * D                                                 # embedding (stage 0)
    dense += 3 * (attn + norms + dense_ffn)                       # layers 0-2
    dense += 3 * (attn + norms + moe_dense)                       # layers 58-60
    dense += D + V * D                                            # final norm + head (stage 15)
    dense += 2 * D + 2 * D * D + attn + norms + moe_dense + D     # MTP: enorm, hnorm, eh_proj, block, norm
    expert = 4 * moe_expert                                       # layers 58-60 + the MTP block
    return dense, expert


def test_v3_671b_pp16_ep64_zero1_rank_memory_matches_hand_calculation(capsys):
    plan = plan_memory(compose_cfg(*V3_LAYOUT), world_size=2048)
    assert (plan.pp, plan.dp, plan.ep, plan.edp) == (16, 128, 64, 2)
    dense, expert = v3_rank0_params_by_hand()
    params = dense + expert                                       # 5.343 B
    weights_gb = 2 * params / 1e9                                 # BF16 compute weights: 10.69 GB
    r0 = plan.ranks[0]
    assert r0.stages == [0, 15]
    assert abs(r0.weights / 1e9 - weights_gb) / weights_gb < 0.05
    assert abs(r0.grads / 1e9 - 4 * params / 1e9) / (4 * params / 1e9) < 0.05          # FP32 grads: 21.37 GB
    optim_gb = 8 * (dense / 128 + expert / 2) / 1e9               # ZeRO-1: dense / dp, experts / edp: 3.11 GB
    assert abs(r0.optim / 1e9 - optim_gb) / optim_gb < 0.05
    assert plan.ranks[15].params == r0.params                     # rank 15 holds the same two stages
    # The CLI prints the same numbers and a verdict.
    assert main([*V3_LAYOUT, "--world-size", "2048", "--gpu-mem-gb", "80", "--recompute", "full"]) == 0
    out = capsys.readouterr().out
    row0 = next(line for line in out.splitlines() if line.split()[:2] == ["0", "0,15"])
    assert f"{params / 1e9:.3f}B" in row0 and f"{weights_gb:.2f}" in row0
    assert "world 2048 = pp 16 x dp 128 (ep 64 x edp 2)" in out and "ZeRO-1" in out
    assert "worst rank: pp rank" in out and ("fits" in out or "does NOT fit" in out)


def test_layouts_pp1_zero2_and_1f1b_embedding_copy():
    base = ["+exp=v3_small", "train.micro_batch_size=1"]
    single = plan_memory(compose_cfg(*base))                      # one rank: everything, no sharding
    assert single.world_size == 1 and len(single.ranks) == 1
    total = single.ranks[0].params
    assert abs(total - 2_161_843_968) < 1e6                        # total with MTP (tools.size's count)
    zero2 = plan_memory(compose_cfg(*base, "parallel.zero=2", "parallel.ep=8", "parallel.ranks_per_node=1"),
                        world_size=16)                            # dp 16, ep 8, edp 2
    r = zero2.ranks[0]
    assert r.grads == pytest.approx(4 * (r.params_dense / 16 + r.params_expert / 2))
    # with a pipeline ZeRO-2 keeps full gradients over the step's micro-batches (reduced at the step, as ZeRO-1)
    piped = plan_memory(compose_cfg(*base, "parallel.zero=2", "parallel.pp=2", "parallel.schedule=1f1b",
                                    "train.global_batch_size=8"), world_size=4)
    assert all(r.grads == pytest.approx(4 * r.params) for r in piped.ranks)
    one_f = plan_memory(compose_cfg(*base, "parallel.pp=2", "parallel.schedule=1f1b", "train.global_batch_size=8"),
                        world_size=2)
    assert "tied embedding copy for MTP" in one_f.ranks[1].notes   # last stage borrows no embedding: a copy


@pytest.mark.parametrize("overrides,message", [
    (["+exp=tiny", "model.n_routed_experts=12", "model.n_expert_groups=3", "parallel.ep=4"],
     "model.n_expert_groups"),   # 3 groups on 4 EP nodes: neither divides the other
    (["+exp=tiny", "parallel.zero=3"], "parallel.zero"),
    (["+exp=tiny", "parallel.pp=2"], "parallel.schedule"),
])
def test_bad_layouts_are_one_line_errors(overrides, message, capsys):
    assert main(overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_flops_per_token_matches_flop_counter_on_tiny(monkeypatch):
    """6N + causal attention vs FlopCounterMode on the tiny model (which counts attention as non-causal: 2x)."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.moe import GroupedExperts
    monkeypatch.setattr(GroupedExperts, "_grouped_mm_ok", staticmethod(lambda x, w: False))   # per-expert mm: counted
    cfg = model_preset("tiny")
    B, T = 2, 64
    model = models.build(cfg, "cpu", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with counter:
        model.compute_loss(ids, ids, mtp_weight=0.3, aux_alpha=1e-4).loss.backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    attention = sum(v for k, v in counts.items() if "bmm" in k or "attention" in k)
    matmul = counter.get_total_flops() - attention
    f = flops_per_token(cfg, T)
    assert matmul / (B * T) == pytest.approx(6 * f.matmul_params, rel=0.03)   # MTP sees T-1 tokens
    assert attention / (B * T) == pytest.approx(2 * f.attention, rel=0.03)


def test_activation_estimate_matches_saved_tensors_on_tiny():
    """The per-token activation formula vs the bytes autograd actually saves (fp32, CPU math attention)."""
    cfg = model_preset("tiny")
    B, T = 2, 64
    measured = saved_bytes(models.build(cfg, "cpu", seed=0), T) / (B * T)
    per = activation_bytes_per_token(cfg, a=4, seq_len=T, math_attention=True)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    estimate = (n_moe * per["moe_layer"] + (cfg.n_layers - n_moe) * per["dense_layer"] + per["head"]
                + cfg.mtp_depth * per["mtp"])
    assert estimate == pytest.approx(measured, rel=0.25)


def test_recompute_modes_order_the_activation_peak(capsys):
    """--recompute: none > selective > full (full above tools.plan's floor; train.recompute the default); a bad
    mode is a one-line error."""
    peaks = {r: plan_memory(compose_cfg(*V3_LAYOUT), world_size=2048, recompute=r).worst.act_peak
             for r in ("none", "selective", "full", "floor")}
    assert peaks["none"] > peaks["selective"] > peaks["full"] > peaks["floor"]
    cfg = compose_cfg("+exp=tiny", "train.recompute=selective")
    plan = plan_memory(cfg)
    assert plan.recompute == "selective"
    assert plan.ranks[0].act_peak == plan_memory(cfg, recompute="selective").ranks[0].act_peak
    assert plan.ranks[0].act_recompute > 0 and plan_memory(cfg, recompute="none").ranks[0].act_recompute == 0
    assert main(["+exp=tiny", "--recompute", "selective"]) == 0
    assert "recompute selective" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["+exp=tiny", "--recompute", "v3"])
    with pytest.raises(ConfigError, match="--recompute: 'v3'"):
        plan_memory(cfg, recompute="v3")


def test_the_fused_head_s_logits_are_counted_in_their_dtype_on_cuda():
    """``train.head_loss=fused`` (the default) keeps each head's BF16 logits on CUDA, not FP32 log-probabilities:
    v3_small's 8 x 2048 micro-batch fits an 80 GB GPU under the trainer's recipe; off CUDA, where the loss runs
    ``F.cross_entropy`` of the FP32 logits, the plan counts those (and so does ``--recipe v3``)."""
    cfg = compose_cfg("+exp=v3_small", "train.micro_batch_size=8")
    cuda, cpu = (plan_memory(cfg, recipe="trainer", device=d).worst for d in ("cuda", "cpu"))
    tokens, V = 8 * 2048, cfg.model.vocab_size
    heads = 1 + cfg.model.mtp_depth
    assert cpu.act_peak - cuda.act_peak == pytest.approx(heads * tokens * (V * (4 - 2) - 4))
    assert cuda.total < 0.9 * 80e9 < cpu.total
    plain = compose_cfg("+exp=v3_small", "train.micro_batch_size=8", "train.head_loss=plain")
    assert plan_memory(plain, recipe="trainer").worst.total == cpu.total
    # train.head_loss=inplace: the logits' buffer (holding their gradient), without fused's FP32 log-sum-exp
    inplace = compose_cfg("+exp=v3_small", "train.micro_batch_size=8", "train.head_loss=inplace")
    assert cuda.act_peak - plan_memory(inplace, recipe="trainer", device="cuda").worst.act_peak == \
        pytest.approx(heads * tokens * 4)
    assert plan_memory(cfg, recipe="v3").worst.act_peak == plan_memory(cfg, recipe="v3", device="cpu").worst.act_peak
