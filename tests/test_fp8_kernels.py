"""FP8 Triton kernels vs ``kernels/reference.py``: quantisers bit-exact, GEMMs within 1e-3 relative of
dequantise-then-matmul, on both load paths (TMA, and pointers: ``{"TMA": False}``, strided views, K % 16 != 0).
Without CUDA under the interpreter (shapes of few large programs); with CUDA compiled, larger shapes too."""
import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402

kernels.configure()   # before the kernel modules are imported: the interpreter when there is no CUDA
from kernels import reference as ref  # noqa: E402
from kernels import gemm as tgemm  # noqa: E402
from kernels import grouped_gemm as tgrouped  # noqa: E402
from kernels import quant as tquant  # noqa: E402

from .fp8_utils import assert_gemm_close  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = ref.FP8_DTYPE
ON_GPU = DEV == "cuda"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32)


def assert_bit_exact(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    mismatch = (bits(got) != bits(want)).sum().item()
    assert mismatch == 0, f"{mismatch} of {got.numel()} differ"


def extreme_rows(M: int, K: int, dtype) -> torch.Tensor:
    """Rows spanning 1e-30..1e30 (inf-free in bf16 too), a zero tile, one tile with a 2^30 dynamic range."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g) * torch.logspace(-30, 30, M)[:, None]
    x[3, :128] = 0.0                                            # all-zero tile
    x[4, :128] = torch.randn(128, generator=g) * 1e-9           # tiny values next to one big value:
    x[4, 7] = 1.0                                               # E4M3 subnormals and flush-to-zero
    x[5, 128:] = 448.0 * 2.0 ** torch.randint(-8, 9, (K - 128,), generator=g).float()  # exact powers of 2
    return x.to(dtype).to(DEV)


def test_cast_is_saturating_round_to_nearest_even():
    grid = ref.cast_to_e4m3(torch.linspace(-448, 448, 4001)).float().unique()   # all normal E4M3 values...
    sub = torch.arange(-8, 9) * 2.0 ** -9                                       # ...and the subnormals
    vals = torch.cat([grid, sub]).unique()
    mids = (vals[1:] + vals[:-1]) / 2                                           # exact ties
    ulp = mids.abs() * 2.0 ** -23
    beyond = torch.tensor([448.5, 464.0, 480.0, 500.0, 1e4, 3e38, float("inf")])
    to_zero = torch.tensor([0.0, 2.0 ** -11, 1e-30, 1e-40])                     # round to zero (1e-40: FP32 subnormal)
    x = torch.cat([vals, mids, mids + ulp, mids - ulp, beyond, -beyond, to_zero, -to_zero, torch.randn(20000) * 100,
                   torch.randn(20000) * 2.0 ** -8]).float().to(DEV)
    assert_bit_exact(tquant.cast_to_e4m3(x), ref.cast_to_e4m3(x))
    assert ref.cast_to_e4m3(torch.tensor([464.0, float("inf"), -1e4])).float().tolist() == [448, 448, -448]
    signed_zeros = tquant.cast_to_e4m3(torch.cat([to_zero, -to_zero]).to(DEV)).view(torch.uint8).tolist()
    assert signed_zeros == [0] * 4 + [0x80] * 4                                 # -0 keeps its sign, as in torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_quant_act_bit_exact(dtype, pow2):
    x = extreme_rows(300, 320, dtype)                            # ragged last tile (320 = 2*128 + 64)
    q, s = tquant.quant_act(x, pow2)
    q_ref, s_ref = ref.quant_act(x, pow2)
    assert_bit_exact(q, q_ref)
    assert_bit_exact(s, s_ref)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert q.float().abs().max() <= 448
    if pow2:
        assert (torch.frexp(s)[0] == 0.5).all()                  # every scale a power of two
    else:                                                        # each tile's amax lands on 448 (x/s may
        q_amax = torch.nn.functional.pad(q.float().abs(), (0, 64)).view(300, 3, 128).amax(-1)   # round past it)
        assert (q_amax[s > ref.AMAX_FLOOR / 448] == 448).all() and (q_amax[3, 0] == 0)


@pytest.mark.parametrize("pow2", [False, True])
def test_quant_weight_bit_exact(pow2):
    w = extreme_rows(3 * 200, 300, torch.bfloat16).view(3, 200, 300)
    q, s, q_t = tquant.quant_weight(w, pow2, transpose=True)
    q_ref, s_ref, q_t_ref = ref.quant_weight(w, pow2, transpose=True)
    assert s.shape == (3, 2, 3)
    for got, want in ((q, q_ref), (s, s_ref), (q_t, q_t_ref)):
        assert_bit_exact(got, want)
    q2, s2 = tquant.quant_weight(w[1].float(), pow2)             # 2-D weight
    assert_bit_exact(q2, q_ref[1])
    assert_bit_exact(s2, s_ref[1])


@pytest.mark.parametrize("counts", [None, [0, 130, 5, 0, 300, 1, 0]], ids=["dense", "experts"])
def test_quant_act_t_bit_exact(counts):
    tpe = None if counts is None else torch.tensor(counts, device=DEV)
    R = 436
    x = extreme_rows(R, 200, torch.float32)
    n = -(-R // 128) + (len(counts) - 1 if counts else 0)
    for pow2 in (False, True):
        q, s = tquant.quant_act_t(x, tpe, pow2)
        q_ref, s_ref = ref.quant_act_t(x, tpe, pow2)
        assert q.shape == (200, R if counts is None else n * 128) and s.shape == (200, n)
        assert q.stride(0) * q.element_size() % 16 == 0           # TMA-readable rows, whatever R is
        assert_bit_exact(q, q_ref)
        assert_bit_exact(s, s_ref)
    x = rand(R, 200)
    q, s = tquant.quant_act_t(x, tpe)
    cols = torch.arange(R, device=DEV) if counts is None else ref.act_t_columns(tpe, R)   # token -> column
    q_tiles = torch.nn.functional.pad(q.float(), (0, n * 128 - q.shape[1])).view(200, n, 128)
    deq = (q_tiles * s[:, :, None]).view(200, n * 128)
    assert ((deq[:, cols].t() - x).norm() / x.norm()) < 0.04
    padding = torch.ones(n * 128, dtype=torch.bool, device=DEV).index_fill_(0, cols, False)
    assert (q_tiles.view(200, -1)[:, padding] == 0).all()          # tile space: zero between experts


@pytest.mark.parametrize("counts", [None, [0, 130, 5, 0, 300, 1, 0]], ids=["dense", "experts"])
def test_quant_act_both_is_the_two_quantisers_bit_for_bit(counts):
    """One launch, both copies, equal to ``quant_act`` / ``quant_act_t`` and the reference, ragged and empty
    experts, zero tiles and subnormals included."""
    tpe = None if counts is None else torch.tensor(counts, device=DEV)
    for dtype, pow2 in ((torch.float32, False), (torch.bfloat16, True)):
        x = extreme_rows(436, 200, dtype)
        got = tquant.quant_act_both(x, tpe, pow2)
        separate = (*tquant.quant_act(x, pow2), *tquant.quant_act_t(x, tpe, pow2))
        for g, k, w in zip(got, separate, ref.quant_act_both(x, tpe, pow2), strict=True):
            assert_bit_exact(g, k)
            assert_bit_exact(g, w)
            assert g.stride() == k.stride()                       # qT's TMA-readable rows too


@pytest.mark.parametrize("shape, counts", [((1, 5), None), ((1, 5), [0, 1, 0]), ((130, 128), [0, 130]),
                                           ((0, 256), [0, 0]), ((0, 256), None)])
def test_quant_act_both_small_and_empty_shapes(shape, counts):
    """A row and a column shorter than a tile, a tile plus two rows, no rows at all."""
    tpe = None if counts is None else torch.tensor(counts, device=DEV)
    x = rand(*shape)
    for pow2 in (False, True):
        got = tquant.quant_act_both(x, tpe, pow2)
        for g, w in zip(got, (*ref.quant_act(x, pow2), *ref.quant_act_t(x, tpe, pow2)), strict=True):
            assert_bit_exact(g, w)


@pytest.mark.parametrize("shape", [(3, 200, 328), (136, 264), (2, 0, 128), (1, 129, 1)])
def test_transpose_fp8_is_torchs_copy_bit_for_bit(shape):
    """The Dgrad operand ``q.mT`` contiguous from the tile-transpose kernel: ragged 3-D and 2-D weights, empty and
    one-column ones; on a GPU the kernel's self-check passes (else torch's copy would run)."""
    q = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(2), dtype=torch.uint8).to(DEV)
    t = tquant.transpose_fp8(q.view(FP8))
    assert t.dtype == FP8 and t.is_contiguous() and torch.equal(t.view(torch.uint8), q.mT.contiguous())
    assert tquant.transpose_self_check(torch.device(DEV)) == 0.0


def test_tile_tables_are_memoised_per_counts_tensor_and_version():
    """The grouped kernels' tile table is computed once per counts tensor (forward and backward of a MoE layer
    share it); an in-place change of the counts, or other rows or block, makes a new, correct one."""
    tpe = torch.tensor([0, 130, 5, 0, 64, 1], device=DEV)
    first = ref.tile_table(tpe, 200, 128, tpe.device)
    assert ref.tile_table(tpe, 200, 128, tpe.device) is first
    assert ref.tile_table(tpe, 200, 64, tpe.device) is not first
    want = ref.segment_tiles(ref.segments(tpe, 200, tpe.device), 200, 128)
    assert all(torch.equal(first[k], want[k]) for k in want)
    tpe[1], tpe[2] = 5, 130                       # same object, new contents: the version counter moved
    again = ref.tile_table(tpe, 200, 128, tpe.device)
    want = ref.segment_tiles(ref.segments(tpe, 200, tpe.device), 200, 128)
    assert again is not first and all(torch.equal(again[k], want[k]) for k in want)
    copy = tpe.clone()                            # equal contents, another tensor: its own entry
    assert ref.tile_table(copy, 200, 128, copy.device) is not again


@pytest.mark.parametrize("block", [64, 128])
def test_segment_tiles_by_definition(block):
    """Each expert's rows in tiles of ``block`` that restart at its first row, in expert order; the unused tiles
    after them empty (start == end); per expert its tiles' range and its rows' range. ``expert_tile_bounds`` gives
    the 128-row tiles' ranges, from a memoised table or computed."""
    counts, rows = [0, 130, 5, 0, 64, 1], 200
    tpe = torch.tensor(counts, device=DEV)
    table = {k: v.tolist() for k, v in ref.segment_tiles(tpe, rows, block).items()}
    assert all(v.dtype == torch.int32 for v in ref.segment_tiles(tpe, rows, block).values())
    want, first, tile = [], 0, 0
    for e, n in enumerate(counts):
        parts = [(first + i, min(first + i + block, first + n), e) for i in range(0, n, block)]
        assert (table["tile_start"][e], table["tile_end"][e]) == (tile, tile + len(parts))
        assert (table["seg_start"][e], table["seg_end"][e]) == (first, first + n)
        want += parts
        first, tile = first + n, tile + len(parts)
    n_tiles = -(-rows // block) + len(counts) - 1
    got = list(zip(table["row_start"], table["row_end"], table["expert"]))
    assert len(got) == n_tiles and got[:len(want)] == want
    assert all(start == end for start, end, _ in got[len(want):])
    if block == 128:
        ref._TILE_TABLES.clear()
        computed = ref.expert_tile_bounds(tpe, tpe.device)
        memoised = ref.expert_tile_bounds(tpe, tpe.device) if ref.tile_table(tpe, rows, 128, tpe.device) else None
        assert memoised[0] is ref.tile_table(tpe, rows, 128, tpe.device)["tile_start"]
        for bounds in (computed, memoised):
            assert [b.tolist() for b in bounds] == [table["tile_start"], table["tile_end"]]


@pytest.mark.skipif(ON_GPU, reason="counts the wrappers' torch ops around the interpreted kernels")
def test_quantiser_and_grouped_wrappers_launch_no_torch_kernels(monkeypatch):
    """Host cost: the dense 128×1 quantiser and the grouped calls (reusing its tile table) launch no torch kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in ("empty", "empty_strided", "slice", "view", "t", "transpose"):
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x, tpe = torch.randn(300, 256), torch.tensor([100, 0, 200])
    (a, sa), (b, sb) = ref.quant_act(x), ref.quant_weight(torch.randn(3, 64, 256))
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kw: None)   # the kernels: not counted
    with Count() as first:
        tquant.quant_act_t(x, tpe)
        tgrouped.grouped_gemm(a, sa, b, sb, tpe, config={"TMA": False})
    assert any("cumsum" in op for op in first.ops), first.ops          # the tables were built here
    xt = ref.quant_act_t(x, tpe)
    with Count() as again:
        tquant.quant_act_t(x)
        tquant.quant_act_t(x, tpe)
        tgrouped.grouped_gemm(a, sa, b, sb, tpe, config={"TMA": False})
        tgrouped.grouped_wgrad(*xt, *xt, tpe, config={"TMA": False})     # the experts' tiles from the same table
    assert again.ops == [], again.ops


def test_all_zero_tiles_have_a_positive_finite_scale():
    z = torch.zeros(64, 256, device=DEV)
    for pow2, expected in ((False, ref.AMAX_FLOOR / 448), (True, 2.0 ** -108)):
        for q, s in (tquant.quant_act(z, pow2), tquant.quant_act_t(z, None, pow2), tquant.quant_weight(z, pow2)):
            assert (q.float() == 0).all()
            assert torch.isfinite(s).all() and (s > 0).all()
            assert torch.allclose(s, torch.full_like(s, expected), rtol=1e-6)


# -------------------------------------------------------------------------------------------------- GEMMs
def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


# (M, N, K), none a multiple of 128. "odd": K and N not multiples of 16, so Fprop and Dgrad cannot use TMA;
# "aligned": they can (TMA zero-fills the ragged last K tile). GPU: + DeepSeek-V3 sizes.
GEMM_SHAPES = {"odd": (300, 200, 520), "aligned": (300, 208, 528)}
if ON_GPU:
    GEMM_SHAPES |= {"v3_up": (4000, 2048, 7168), "v3_down": (1000, 7168, 2048)}
PATHS = {"auto": None, "pointers": {"TMA": False}}
LAYOUTS = ["fprop", "dgrad", "dgrad_strided", "wgrad", "wgrad_strided"]
# "auto" takes TMA where the operands allow it; forcing pointers differs only for aligned, unstrided operands
GEMM_CASES = [(layout, shape, path) for layout in LAYOUTS for shape in GEMM_SHAPES for path in PATHS
              if path == "auto" or (shape != "odd" and "strided" not in layout)]


@pytest.mark.parametrize("layout,shape,path", GEMM_CASES)
def test_gemm_layouts_match_reference(layout, shape, path):
    M, N, K = GEMM_SHAPES[shape]                                 # ragged M, N; K not a multiple of 128
    x, w, dy = rand(M, K, seed=1), rand(N, K, seed=2), rand(M, N, seed=3)
    wq, ws, wq_t = ref.quant_weight(w, transpose=True)
    if layout == "fprop":
        args, exact = (*ref.quant_act(x), wq, ws), x @ w.t()
    elif layout.startswith("dgrad"):
        b = wq_t if layout == "dgrad" else wq.t()                # K-contiguous copy, or a strided view
        args, exact = (*ref.quant_act(dy), b, ws.t()), dy @ w
    else:                                                        # the kernel quantiser: rows 16-byte aligned
        (dy_t, dy_ts), (x_t, x_ts) = tquant.quant_act_t(dy), tquant.quant_act_t(x)
        if layout == "wgrad_strided":                            # same values, token-major storage
            dy_t, x_t = dy_t.t().contiguous().t(), x_t.t().contiguous().t()
        args, exact = (dy_t, dy_ts, x_t, x_ts), dy.t() @ x
    contraction = {"fprop": K, "dgrad": N, "wgrad": 16}[layout.split("_")[0]]     # wgrad: rows padded to 16
    assert tgemm.tma_ok(args[0], args[2]) == ("strided" not in layout and contraction % 16 == 0)
    out = tgemm.gemm(*args, out_dtype=torch.float32, config=PATHS[path])
    assert_gemm_close(out, ref.gemm(*args, out_dtype=torch.float32))
    assert ((out - exact).norm() / exact.norm()) < 0.05          # FP8 quantisation error, ~0.036


def three_gemms(a_scale=None, at_scale=None):
    """``out(dtype, config)`` of the dense GEMM, the grouped GEMM and the grouped Wgrad on small ragged operands
    (``a_scale`` / ``at_scale``: a value for the first scale of the dense/grouped input and of the Wgrad's)."""
    tpe = torch.tensor([130, 0, 70], device=DEV)
    a, sa = ref.quant_act(rand(200, 384, seed=4))
    b, sb = ref.quant_weight(rand(136, 384, seed=5))
    bg, sbg = ref.quant_weight(rand(3, 136, 384, seed=6))
    at, sat = tquant.quant_act_t(rand(200, 136, seed=7), tpe)
    bt, sbt = tquant.quant_act_t(rand(200, 384, seed=8), tpe)
    if a_scale is not None:
        sa[0, 0], sat[0, 0] = a_scale, at_scale
    return (lambda dt, cfg=None: tgemm.gemm(a, sa, b, sb, dt, config=cfg),
            lambda dt, cfg=None: tgrouped.grouped_gemm(a, sa, bg, sbg, tpe, dt, config=cfg),
            lambda dt, cfg=None: tgrouped.grouped_wgrad(at, sat, bt, sbt, tpe, dt, config=cfg)[0])


@pytest.mark.parametrize("path", list(PATHS))
def test_gemm_bf16_output_is_rounded_fp32_result(path):
    """BF16 outputs are the FP32 results cast (round to nearest even), bit for bit: dense, grouped and grouped
    Wgrad."""
    for op in three_gemms():
        assert_bit_exact(op(torch.bfloat16, PATHS[path]).view(torch.int16).float(),
                         op(torch.float32, PATHS[path]).to(torch.bfloat16).view(torch.int16).float())


def test_bf16_output_keeps_cudas_nan():
    """A NaN accumulator (CUDA's own NaN, 0x7FFFFFFF, from a NaN scale here) stays NaN in a BF16 output, in each of
    the three GEMMs; the rounding's carry once made it -0.0, hiding a diverged step. The other rows are finite."""
    nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32).to(DEV)[0]
    for op in three_gemms(nan, nan):
        out = op(torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out[0].isnan().all() and out[1:].isfinite().all()


def test_load_path_choice():
    """TMA exactly when both operands are K-contiguous with 16-byte-aligned base and row strides."""
    q = tquant.quant_act(rand(64, 256))[0]
    assert tgemm.tma_ok(q, q) and not tgemm.tma_ok(q, q.t()) and not tgemm.tma_ok(q[:, 8:], q)
    assert not tgemm.tma_ok(ref.quant_act(rand(64, 520))[0], q)
    assert tgemm.tma_ok(tquant.quant_act_t(rand(300, 64))[0], q)        # 300 tokens: padded row stride
    assert tgemm.pick_config(300, 200, True)["TMA"] and not tgemm.pick_config(300, 200, True, {"TMA": False})["TMA"]
    assert not tgemm.pick_config(300, 200, False, {"TMA": True})["TMA"]   # never forced onto bad operands
    if ON_GPU:
        assert tgemm.pick_config(300, 200, True) == tgemm.GPU_CONFIG
        assert tgemm.pick_config(300, 200, False) == tgemm.POINTER_CONFIG


COUNTS = {"ragged": [0, 130, 5, 0, 300, 1, 0], "one_expert": [0, 0, 436], "all_empty": [0, 0, 0]}
EXPERT_DIMS = {"odd": (200, 136), "aligned": (272, 144)}         # (D, F): "odd" cannot use TMA
if ON_GPU:
    COUNTS |= {"v3_ragged": [0, 700, 1, 1499, 0, 513, 1300, 83]}
    EXPERT_DIMS |= {"v3": (7168, 2048)}


DIMS_PATHS = [(dims, path) for dims in EXPERT_DIMS for path in PATHS if dims != "odd" or path == "auto"]


@pytest.mark.parametrize("dims,path", DIMS_PATHS)
@pytest.mark.parametrize("case", list(COUNTS))
def test_grouped_gemm_fprop_dgrad_match_reference(case, dims, path):
    tpe = torch.tensor(COUNTS[case], device=DEV)
    (E, R), (D, F) = (tpe.numel(), int(tpe.sum())), EXPERT_DIMS[dims]
    x, w, dy = rand(R, D, seed=6), rand(E, F, D, seed=7), rand(R, F, seed=8)
    wq, ws, wq_t = ref.quant_weight(w, transpose=True)
    cases = [(ref.quant_act(x), wq, ws), (ref.quant_act(dy), wq_t, ws.mT)]     # Fprop, Dgrad
    if path == "auto":
        cases.append((ref.quant_act(dy), wq.mT, ws.mT))                        # Dgrad from a strided view
    for a, b, sb in cases:
        out = tgrouped.grouped_gemm(*a, b, sb, tpe, torch.float32, config=PATHS[path])
        assert_gemm_close(out, ref.grouped_gemm(*a, b, sb, tpe, torch.float32))


@pytest.mark.parametrize("dims,path", DIMS_PATHS)
@pytest.mark.parametrize("case", list(COUNTS))
def test_grouped_wgrad_matches_reference(case, dims, path):
    tpe = torch.tensor(COUNTS[case], device=DEV)
    (E, R), (D, F) = (tpe.numel(), int(tpe.sum())), EXPERT_DIMS[dims]
    x, dy = rand(R, D, seed=9), rand(R, F, seed=10)
    args = (*tquant.quant_act_t(dy, tpe), *tquant.quant_act_t(x, tpe), tpe)   # tile space: TMA-eligible
    assert tgemm.tma_ok(args[0], args[2])
    out = tgrouped.grouped_wgrad(*args, config=PATHS[path])
    assert out.shape == (E, F, D)
    assert_gemm_close(out, ref.grouped_wgrad(*args))
    for e, n in enumerate(COUNTS[case]):
        if n == 0:
            assert (out[e] == 0).all()
    if R:                                                        # vs the per-expert products of the tokens
        exact = torch.stack([d.t() @ xe for d, xe in zip(dy.split(COUNTS[case]), x.split(COUNTS[case]))])
        assert ((out - exact).norm() / exact.norm()) < 0.05


@triton.jit
def _tile_order_kernel(out_ptr, grid_m, grid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = tgemm.tile_order(pid, grid_m, grid_n, GROUP_M)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_n)


@pytest.mark.parametrize("group_m", [1, 3, 4, 16])
def test_tile_order_visits_every_tile_once_in_groups(group_m):
    grid_m, grid_n = 7, 5
    out = torch.full((grid_m * grid_n, 2), -1, dtype=torch.int32, device=DEV)
    _tile_order_kernel[(grid_m * grid_n,)](out, grid_m, grid_n, GROUP_M=group_m)
    order = [tuple(t) for t in out.tolist()]
    assert sorted(order) == [(m, n) for m in range(grid_m) for n in range(grid_n)]
    want = [(m, n) for first in range(0, grid_m, group_m)      # group_m rows over every column, column by column
            for n in range(grid_n) for m in range(first, min(first + group_m, grid_m))]
    assert order == want


@pytest.mark.parametrize("group_m", [0, 1, 3, 16])
def test_grouped_gemm_program_order_gives_the_same_product(group_m):
    """Several row and column tiles per expert (64-wide column tiles), in each program order: every output tile
    written once, equal to the reference."""
    counts = COUNTS["ragged"]
    tpe = torch.tensor(counts, device=DEV)
    (E, R), (D, F) = (tpe.numel(), sum(counts)), EXPERT_DIMS["aligned"]
    wq, ws, wq_t = ref.quant_weight(rand(E, F, D, seed=11), transpose=True)
    for a, b, sb in [(ref.quant_act(rand(R, D, seed=12)), wq, ws), (ref.quant_act(rand(R, F, seed=13)), wq_t, ws.mT)]:
        out = tgrouped.grouped_gemm(*a, b, sb, tpe, torch.float32, config={"BLOCK_N": 64, "GROUP_M": group_m})
        assert_gemm_close(out, ref.grouped_gemm(*a, b, sb, tpe, torch.float32))


@pytest.mark.parametrize("block_m", [32, 64])
def test_grouped_gemm_reads_the_quantisers_tile_table_in_parts(block_m, monkeypatch):
    """``DSV3_FP8_SHARED_TILES=1``, BLOCK_M 32 or 64: the 128-row table that the 128×1 quantiser built, each tile
    read as 128 / BLOCK_M row tiles (experts of 1, 5, 130 and 300 rows: parts empty, partial and full), the product
    the reference's; no table of its own is built. Off, the GEMM builds its own."""
    monkeypatch.delenv(ref.SHARED_TILES_ENV, raising=False)
    assert ref.table_block(block_m) == block_m                       # off by default: a table of its own
    monkeypatch.setenv(ref.SHARED_TILES_ENV, "1")
    counts = COUNTS["ragged"]
    tpe = torch.tensor(counts, device=DEV)
    (E, R), (D, F) = (tpe.numel(), sum(counts)), EXPERT_DIMS["aligned"]
    x = rand(R, D, seed=14)
    tquant.quant_act_t(x, tpe)
    tables = {k for k in ref._TILE_TABLES if k[0] == id(tpe)}
    assert {k[3] for k in tables} == {128} and ref.table_block(block_m) == 128
    wq, ws = ref.quant_weight(rand(E, F, D, seed=15))
    a = ref.quant_act(x)
    out = tgrouped.grouped_gemm(*a, wq, ws, tpe, torch.float32, config={"BLOCK_M": block_m, "GROUP_M": 3})
    assert_gemm_close(out, ref.grouped_gemm(*a, wq, ws, tpe, torch.float32))
    assert {k for k in ref._TILE_TABLES if k[0] == id(tpe)} == tables


# ------------------------------------------------------------------------------- 128-element promotion
def truncate_mantissa(x: torch.Tensor, bits: int = 13) -> torch.Tensor:
    """Round FP32 toward zero to ``bits`` explicit mantissa bits (14 significant: Hopper FP8 accumulation)."""
    return (x.view(torch.int32) & ~((1 << (23 - bits)) - 1)).view(torch.float32)


def low_precision_sum(A: torch.Tensor, B: torch.Tensor, promote_every: int | None) -> torch.Tensor:
    """``A·Bᵀ`` summed one product at a time into a 14-bit accumulator, promoted to FP32 every N products."""
    acc, total = A.new_zeros(A.shape[0], B.shape[0]), A.new_zeros(A.shape[0], B.shape[0])
    for k in range(A.shape[1]):
        acc = truncate_mantissa(acc + A[:, k, None] * B[None, :, k])
        if promote_every and (k + 1) % promote_every == 0:
            total, acc = total + acc, torch.zeros_like(acc)
    return total + acc


def test_fp32_promotion_every_128_keeps_error_bounded_in_k():
    """Emulated single low-precision accumulation over all of K drifts ~linearly with K (all-positive
    inputs, truncating 14-bit accumulator); promotion every 128 keeps it flat; the kernel is ~fp32 under the
    interpreter and, on a GPU, no worse than the emulated promotion and flat in K."""
    errs = {}
    for K in (512, 4096, 16384):
        a, b = rand(32, K, seed=K).abs(), rand(32, K, seed=K + 1).abs()
        (aq, sa), (bq, sb) = ref.quant_act(a), ref.quant_weight(b)
        A, B = ref.dequant(aq, sa).cpu(), ref.dequant(bq, sb, 128).cpu()
        exact = A.double() @ B.double().t()

        def err(y):
            return ((y.double().cpu() - exact).abs() / exact.abs()).max().item()
        errs[K] = (err(tgemm.gemm(aq, sa, bq, sb, torch.float32)), err(low_precision_sum(A, B, 128)),
                   err(low_precision_sum(A, B, None)))
    kernel, promoted, single = zip(*errs.values())
    print({K: tuple(f"{e:.1e}" for e in v) for K, v in errs.items()})   # measured: see docs/fp8.md
    if ON_GPU:      # tensor cores sum each 128-product tile in limited precision, then the kernel promotes
        assert max(kernel) < 2 * max(promoted) and kernel[-1] < 2 * kernel[0] + 1e-5
    else:           # the interpreter's dot is FP32
        assert max(kernel) < 1e-5
    assert max(promoted) < 1e-2 and promoted[-1] < 2 * promoted[0]     # bounded, no growth with K
    assert single[-1] > 8 * single[0] and single[-1] > 20 * promoted[-1]
