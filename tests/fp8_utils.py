"""What the kernel tests share: their device, a clean self-check state per test, the FP8 GEMMs' closeness bound."""
import pytest
import torch

DEV = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_verdicts():
    """No self-check verdict cached before or after the test (autouse where imported)."""
    from kernels import selfcheck
    selfcheck.forget()
    yield
    selfcheck.forget()


def assert_gemm_close(out: torch.Tensor, want: torch.Tensor) -> None:
    """``out`` within 1e-3 of the FP32 reference, relative to the largest output: Hopper's FP8 tensor cores keep
    about 14 bits inside a 128-element block, so an element's error follows the row's scale, not its own value
    (~1e-4 of the largest output measured on an H100)."""
    assert out.shape == want.shape, (out.shape, want.shape)
    atol = 1e-3 * want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-3, atol=atol)
