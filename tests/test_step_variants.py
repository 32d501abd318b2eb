"""``bench.step_variants`` without a GPU: its variants' table and the environment a variant runs in."""
import os

from bench import step_variants as sv
from kernels.quant import FUSED_ENV, TRANSPOSE_ENV
from kernels.reference import SHARED_TILES_ENV
from parallel.compile import CHECK_ENV, GATHER_ENV, HEADS_ENV, RESIDUAL_ENV, UNSORT_ENV
from parallel.fp8 import WGRAD_BF16_ENV


def test_every_variant_is_complete_and_j_sets_the_fused_quantiser_only_inside(monkeypatch):
    assert all(len(v) == 7 for v in sv.VARIANTS.values()) and set(sv.ENV) <= set(sv.VARIANTS)
    assert sv.VARIANTS["J"][1:] == sv.VARIANTS["K"][1:] == sv.VARIANTS["H"][1:]
    assert sv.ENV == {"J": {FUSED_ENV: "1"}, "K": {TRANSPOSE_ENV: "0"}, "L": {CHECK_ENV: "1"}, "M": {RESIDUAL_ENV: "1"},
                      "P": {GATHER_ENV: "1"}, "Q": {UNSORT_ENV: "1"}, "R": {HEADS_ENV: "1"},
                      "S": {WGRAD_BF16_ENV: "1"}, "T": {SHARED_TILES_ENV: "1"}}
    assert sv.VARIANTS["L"][1:] == sv.VARIANTS["M"][1:] == sv.VARIANTS["G"][1:]
    monkeypatch.delenv(FUSED_ENV, raising=False)
    with sv.variant_env("J"):
        assert os.environ[FUSED_ENV] == "1"
    assert FUSED_ENV not in os.environ
    monkeypatch.setenv(FUSED_ENV, "0")
    with sv.variant_env("J"), sv.variant_env("H"):
        assert os.environ[FUSED_ENV] == "1"
    assert os.environ[FUSED_ENV] == "0"
    assert sv.main(["--variants", "J"]) == 2   # no CUDA here: one line, exit 2


def test_pending_variants_are_g_with_one_opt_in_each(capsys):
    """``--variants pending``: G and each opt-in waiting for a GPU, each G's settings with one environment
    variable or head loss of its own (``pending-fp8``: H's); an unknown key is refused before CUDA is asked for."""
    from parallel.head_loss import HEAD_LOSSES
    from parallel.zero import MASTERS
    assert sv.PENDING and set(sv.PENDING) <= set(sv.VARIANTS) and "G" not in sv.PENDING
    for base, pending in (("G", sv.PENDING), ("H", sv.PENDING_FP8)):      # H: the FP8 step's opt-ins
        for key in pending:
            assert sv.VARIANTS[key][1:] == sv.VARIANTS[base][1:]
            assert (key in sv.ENV) + (key in sv.HEAD_LOSS) + (key in sv.MASTER) == 1, key
    assert not set(sv.PENDING) & set(sv.PENDING_FP8)
    assert set(sv.HEAD_LOSS.values()) <= set(HEAD_LOSSES) - {"fused"}
    assert set(sv.MASTER.values()) <= set(MASTERS) - {"fp32"}
    assert sv.main(["--variants", "G,Z"]) == 2
    assert "Z not in" in capsys.readouterr().err


def _layout_change(x):
    return (x @ x).t().contiguous()


def _profiled_rows(rows_of, fn, *args):
    """``rows_of`` (``op_rows``, ``copy_rows``) over a real CPU profile of ``fn(*args)``, CPU time standing in for
    the GPU's."""
    from torch.profiler import ProfilerActivity, profile

    from bench.train_check import OP_FRAMES, stack_config
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True,
                 experimental_config=stack_config()) as prof:
        fn(*args)
    return rows_of(prof.key_averages(group_by_input_shape=True, group_by_stack_n=OP_FRAMES),
                   time_of=lambda e: e.self_cpu_time_total)


def test_op_rows_name_the_op_its_shapes_and_the_calling_line():
    """``bench.train_check.op_rows``: the copy that ``contiguous`` makes is named with its input shape, the Tensor
    method and this file's calling line."""
    import torch

    from bench.train_check import op_rows
    rows = _profiled_rows(op_rows, _layout_change, torch.randn(256, 256))
    ops = {r[0]: r for r in rows}
    assert {"aten::mm", "aten::clone"} <= set(ops), rows
    op, shapes, where, calls, ms = ops["aten::clone"]
    assert shapes == "[[256, 256], []]" and calls == 1 and ms > 0
    method, line, *outer = where.split(" < ")
    assert method == "contiguous()" and line.startswith("tests/test_step_variants.py(") and \
        line.endswith("): _layout_change"), where
    assert all(f.startswith("tests/") for f in outer), where   # pytest's own frames are not the repository's
    assert ops["aten::mm"][2].split(" < ")[0] == line, ops["aten::mm"]


def _casts(x):
    import torch
    return x.to(torch.float64), x.t().contiguous()


def test_copy_rows_list_every_copy_and_cast_with_its_calling_line():
    """``bench.train_check.copy_rows``: the copies alone, each with its shapes and this file's calling line (and
    the Tensor method, where the profiler gave the copy its stack: ``to``), however small; nothing but copies."""
    import torch

    from bench.train_check import copy_rows
    rows = _profiled_rows(copy_rows, _casts, torch.randn(64, 32))
    assert {r[0] for r in rows} == {"aten::copy_"}, rows
    assert len(rows) == 2 and all("tests/test_step_variants.py(" in r[2] and "): _casts" in r[2] for r in rows), rows
    assert sorted(r[1] for r in rows) == ["[[32, 64], [32, 64], []]", "[[64, 32], [64, 32], []]"], rows
    assert any(r[2].startswith("to() < ") for r in rows), rows
