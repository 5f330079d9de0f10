import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on cpu, and on cuda where a GPU is visible; the cuda
    # case is listed (and skipped) without one, so a CPU run shows what it did not cover.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device",
            ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
