import pytest
import torch

from indexcache import ops


@pytest.mark.parametrize("rows,width,num_rows", [(8, 2048, 5), (3, 7, 3), (16, 64, 0), (1, 1, 1)])
def test_fill_topk_buffer(device, rows, width, num_rows):
    buf = torch.randint(0, 1000, (rows, width), dtype=torch.int32, device=device)
    before = buf.clone()
    out = ops.fill_topk_buffer_(buf, num_rows)
    assert out is buf
    assert (buf[:num_rows] == -1).all()
    assert torch.equal(buf[num_rows:], before[num_rows:])


def test_fill_topk_buffer_strided_rows(device):
    big = torch.randint(0, 1000, (6, 40), dtype=torch.int32, device=device)
    view = big[:, 4:36]  # row stride 40, width 32
    before = big.clone()
    ops.fill_topk_buffer_(view, 4)
    assert (big[:4, 4:36] == -1).all()
    assert torch.equal(big[:4, :4], before[:4, :4]) and torch.equal(big[:4, 36:], before[:4, 36:])
    assert torch.equal(big[4:], before[4:])


def test_fill_topk_buffer_errors(device):
    with pytest.raises(RuntimeError, match="must be Int"):
        ops.fill_topk_buffer_(torch.zeros(4, 4, dtype=torch.int64, device=device), 1)
    with pytest.raises(RuntimeError, match="exceeds the topk buffer's 4 rows"):
        ops.fill_topk_buffer_(torch.zeros(4, 4, dtype=torch.int32, device=device), 5)
    with pytest.raises(RuntimeError, match="must have 2 dims"):
        ops.fill_topk_buffer_(torch.zeros(4, dtype=torch.int32, device=device), 1)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        ops.fill_topk_buffer_(torch.zeros(4, 4, dtype=torch.int32, device=device).t(), 1)
    with pytest.raises(RuntimeError, match="num_rows must be >= 0"):
        ops.fill_topk_buffer_(torch.zeros(4, 4, dtype=torch.int32, device=device), -1)


def test_fill_opcheck():
    buf = torch.zeros(4, 16, dtype=torch.int32)
    torch.library.opcheck(torch.ops.indexcache.fill_topk_buffer_.default, (buf, 3))
