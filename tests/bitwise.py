"""Bit-level comparison for the fuzz tests (tests/test_fuzz.py and the emulator's
csrc/tests/cuda_emu/test_emu_fuzz.py, which loads this file by path). Pure torch."""

import torch


def bits(t):
    """The raw bits of t as an integer tensor of the same element size."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def nan_equal(a, b):
    """Bit-equal, except that any NaN equals any NaN (payload and sign are unspecified:
    torch and the kernels round a float NaN to different bf16 NaNs)."""
    if a.dtype == torch.uint8 and a.shape[-1] == 656:  # fp8_ds_mla rows
        a, b = a.reshape(-1, 656), b.reshape(-1, 656)
        return (torch.equal(a[:, :512], b[:, :512])
                and nan_equal(a[:, 512:528].contiguous().view(torch.float32), b[:, 512:528].contiguous().view(torch.float32))
                and nan_equal(a[:, 528:].contiguous().view(torch.bfloat16), b[:, 528:].contiguous().view(torch.bfloat16)))
    if a.dtype in (torch.float32, torch.bfloat16):
        na, nb = torch.isnan(a), torch.isnan(b)
        return torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb])
    return torch.equal(a, b)
