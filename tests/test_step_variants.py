"""``bench.step_variants`` without a GPU: its variants' table and the environment a variant runs in."""
import os

from bench import step_variants as sv
from kernels.quant import FUSED_ENV, TRANSPOSE_ENV
from parallel.compile import CHECK_ENV


def test_every_variant_is_complete_and_j_sets_the_fused_quantiser_only_inside(monkeypatch):
    assert all(len(v) == 7 for v in sv.VARIANTS.values()) and set(sv.ENV) <= set(sv.VARIANTS)
    assert sv.VARIANTS["J"][1:] == sv.VARIANTS["K"][1:] == sv.VARIANTS["H"][1:]
    assert sv.ENV == {"J": {FUSED_ENV: "1"}, "K": {TRANSPOSE_ENV: "1"}, "L": {CHECK_ENV: "1"}}
    assert sv.VARIANTS["L"][1:] == sv.VARIANTS["G"][1:]
    monkeypatch.delenv(FUSED_ENV, raising=False)
    with sv.variant_env("J"):
        assert os.environ[FUSED_ENV] == "1"
    assert FUSED_ENV not in os.environ
    monkeypatch.setenv(FUSED_ENV, "0")
    with sv.variant_env("J"), sv.variant_env("H"):
        assert os.environ[FUSED_ENV] == "1"
    assert os.environ[FUSED_ENV] == "0"
    assert sv.main(["--variants", "J"]) == 2   # no CUDA here: one line, exit 2
