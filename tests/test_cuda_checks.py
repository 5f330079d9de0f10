"""The INDEXCACHE_CHECK switch and the CUDA error word (issue 12).

CUDA ops validate index values on the device by default (out-of-range entries become
invalid and are counted, no host sync); INDEXCACHE_CHECK=1 restores the host checks with
the CPU ops' messages. The CPU ops always check on the host. Kernel behaviour is tested
without a GPU in csrc/tests/cuda_emu/test_emu_validation.py; the CUDA cases here run only
where a GPU is present (bench/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from indexcache import ops

CUDA = torch.cuda.is_available()


def slots_inputs(device):
    positions = torch.tensor([[0, 5, -1], [3, 99, 1]], dtype=torch.int32, device=device)  # 99: past the table
    req = torch.tensor([0, 1], dtype=torch.int32, device=device)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device)
    return positions, req, table


@pytest.mark.parametrize("switch", [None, "0", "1", ""])
def test_cpu_ops_raise_whatever_the_switch(monkeypatch, switch):
    if switch is None:
        monkeypatch.delenv("INDEXCACHE_CHECK", raising=False)
    else:
        monkeypatch.setenv("INDEXCACHE_CHECK", switch)
    positions, req, table = slots_inputs("cpu")
    with pytest.raises(RuntimeError, match=r"positions\[1, 1\]=99 needs block 24 but the block table has 2 columns"):
        ops.positions_to_slots(positions, req, table, 4, 4)
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match=r"row 1 has window \[ks, ke\) = \[3, 11\)"):
        ops.topk_indices(logits, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([10, 11], dtype=torch.int32), 4)


def test_error_count_of_a_cpu_device_is_zero():
    assert ops.cuda_error_count("cpu") == 0
    ops.reset_cuda_error_count(torch.device("cpu"))  # a no-op, not an error


def test_error_word_schema_and_fake():
    schema = str(torch.ops.indexcache.cuda_error_word.default._schema)
    assert schema == "indexcache::cuda_error_word(Tensor like) -> Tensor"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        like = torch.empty(0)
        w = torch.ops.indexcache.cuda_error_word(like)
    assert w.shape == (1,) and w.dtype == torch.int32


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_counts_instead_of_syncing(monkeypatch):
    monkeypatch.delenv("INDEXCACHE_CHECK", raising=False)
    positions, req, table = slots_inputs("cuda")
    ops.reset_cuda_error_count()
    out = ops.positions_to_slots(positions, req, table, 4, 4)
    assert out.cpu().tolist() == [[8, 1, -1], [7, -1, 5]]
    assert ops.cuda_error_count() == 1
    logits = torch.randn(2, 10, device="cuda")
    sel = ops.topk_indices(logits, torch.tensor([0, 3], dtype=torch.int32, device="cuda"),
                           torch.tensor([10, 11], dtype=torch.int32, device="cuda"), 4)
    assert (sel[1] == -1).all().item()
    assert ops.cuda_error_count() == 2
    ops.reset_cuda_error_count()
    assert ops.cuda_error_count() == 0


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_host_checks_restored_by_the_switch(monkeypatch):
    monkeypatch.setenv("INDEXCACHE_CHECK", "1")
    positions, req, table = slots_inputs("cuda")
    with pytest.raises(RuntimeError, match=r"positions\[1, 1\]=99 needs block 24 but the block table has 2 columns"):
        ops.positions_to_slots(positions, req, table, 4, 4)
