"""What the compiled CUDA kernels are made of, read from the built extension's SASS.

No GPU needed: ``cuobjdump -sass`` disassembles the sm_90a cubins inside indexcache/_C*.so
and each test asserts a property the design promises for named kernels (docs/cuda_kernels.md):
tensor-core instructions (HMMA) where the kernels use mma.sync, no local-memory traffic
(LDL/STL: register spills or stack arrays) in the listed kernels, and no byte loads from
global memory in the aligned sparse-MLA staging (the fp8_ds_mla RoPE part is copied in
16-byte pieces), cp.async (LDGSTS) and no byte loads in the aligned indexer kernels, and the fp8
warpgroup MMA (QGMMA) in the indexer's sm_90a wgmma kernels. Outside CI, skipped with the reason
when cuobjdump is not found, fails or the extension was built without CUDA; in CI (``CI`` set, as
``.ci/run`` does: nvcc 13 and torch's CUDA build, whose triton ships cuobjdump) each of these
fails instead. ``INDEXCACHE_CUOBJDUMP`` names the tool explicitly.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ARCH = "sm_90a"


def _cuobjdump() -> str | None:
    explicit = os.environ.get("INDEXCACHE_CUOBJDUMP")
    if explicit:
        return explicit
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"))
    for base in sys.path:  # the pip CUDA packages (nvidia/cu13/bin) and triton ship one
        candidates += glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump"))
        candidates += glob.glob(os.path.join(base, "triton", "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def _extension() -> str | None:
    spec = importlib.util.find_spec("indexcache")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        libs = sorted(Path(loc).glob("_C*.so"))
        if libs:
            return str(libs[0])
    return None


def _cannot_read(why: str):
    """Skip with `why`, or fail in CI, where the tool and a CUDA build are part of the setup."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}; in CI (CI={os.environ['CI']}) the SASS checks must run")
    pytest.skip(why)


@functools.lru_cache(maxsize=1)
def sass() -> dict[str, list[str]]:
    """Mangled kernel name -> its SASS opcodes (with modifiers, predicates dropped), for ARCH."""
    tool, lib = _cuobjdump(), _extension()
    if tool is None:
        _cannot_read("cuobjdump not found (PATH, /usr/local/cuda*/bin, the pip nvidia / triton packages)")
    if lib is None:
        _cannot_read("indexcache._C is not built")
    elves = subprocess.run([tool, "-lelf", lib], capture_output=True, text=True)
    if elves.returncode != 0:
        _cannot_read(f"{tool} -lelf failed ({elves.returncode}): {elves.stderr.strip()[:300]}")
    if f"{ARCH}.cubin" not in elves.stdout:
        _cannot_read(f"the extension holds no {ARCH} code (built without CUDA or for other targets)")
    out = subprocess.run([tool, "-sass", "-arch", ARCH, lib], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, list[str]] = {}
    cur = None
    instr = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            kernels.setdefault(cur, [])
            continue
        if cur is not None:
            m = instr.search(line)
            if m:
                kernels[cur].append(m.group(1))
    return kernels


def kernel(pattern: str) -> list[str]:
    """The opcodes of the one kernel whose mangled name contains every '|'-separated part."""
    parts = pattern.split("|")
    names = [n for n in sass() if all(p in n for p in parts)]
    assert len(names) == 1, f"{pattern!r} matches {names or 'no kernel'} among {sorted(sass())}"
    return sass()[names[0]]


def count(ops: list[str], *prefixes: str) -> int:
    return sum(1 for op in ops if any(op == p or op.startswith(p + ".") for p in prefixes))


# Mangled-name fragments: Elem is h (uint8_t, fp8), t (uint16_t, bf16), f (float); then Paged; then
# kPadHeads (heads not a multiple of 16: small models only, a check in the hot loop); then Vec
# (16-byte aligned q, keys and scales: the cp.async key ring; false: the misaligned fallback,
# synchronous byte-safe staging, always with the padded-heads check); then Wg (the sm_90a fp8
# warpgroup-MMA kernels: aligned fp8, h % 64 == 0).
FP8_DENSE, BF16_DENSE, FP8_PAGED = "IhLb0ELb0ELb1ELb0E", "ItLb0ELb0ELb1ELb0E", "IhLb1ELb0ELb1ELb0E"
PADDED = ["IhLb0ELb1ELb1ELb0E", "ItLb0ELb1ELb1ELb0E", "IhLb1ELb1ELb1ELb0E"]
MISALIGNED = ["IhLb0ELb1ELb0ELb0E", "ItLb0ELb1ELb0ELb0E", "IhLb1ELb1ELb0ELb0E"]
WGMMA = ["IhLb0ELb0ELb1ELb1E", "IhLb1ELb0ELb1ELb1E"]
# sparse_mla_mma_kernel<NG, Vec, D>: NG head groups of 16 per CTA (1, 2, 4), Vec = 16-byte aligned
# inputs (cp.async staging) or not (byte loads), D = d_qk (576: DSA, any cache; 512: DeepSeek-V4's
# K=V head, bf16 / fp32 caches only, so no fp8 conversion in it).
SPARSE_MLA_ALIGNED = [f"sparse_mla_mma_kernelILi{ng}ELb1ELi576E" for ng in (1, 2, 4)]
SPARSE_MLA_BYTES = [f"sparse_mla_mma_kernelILi{ng}ELb0ELi576E" for ng in (1, 2, 4)]
SPARSE_MLA_V4_ALIGNED = [f"sparse_mla_mma_kernelILi{ng}ELb1ELi512E" for ng in (1, 2, 4)]
SPARSE_MLA_V4_BYTES = [f"sparse_mla_mma_kernelILi{ng}ELb0ELi512E" for ng in (1, 2, 4)]
SPARSE_MLA_MMA = SPARSE_MLA_ALIGNED + SPARSE_MLA_BYTES + SPARSE_MLA_V4_ALIGNED + SPARSE_MLA_V4_BYTES
MMA_KERNELS = [
    "indexer_logits_kernel|" + FP8_DENSE, "indexer_logits_kernel|" + BF16_DENSE, "indexer_logits_kernel|" + FP8_PAGED,
    "indexer_fused_kernel|" + FP8_DENSE, "indexer_fused_kernel|" + BF16_DENSE, "indexer_fused_kernel|" + FP8_PAGED,
] + SPARSE_MLA_MMA + [f"indexer_{kind}_kernel|{frag}" for kind in ("logits", "fused") for frag in PADDED + MISALIGNED]
# Kernels with no local memory at all (no spills, no stack arrays). The remaining indexer
# kernels (bf16 logits, fp32, padded heads) are asserted below with the issue 12 checks.
NO_LOCAL = [
    "quantize_kernel", "index_k_insert_kernel", "mla_insert_kernel", "positions_to_slots_kernel",
    "sanitize_windows_kernel", "sanitize_seq_lens_kernel", "paged_windows_kernel",
    "topk_rows_kernel", "topk_partial_kernel", "topk_merge_kernel", "fill_topk_buffer_kernel",
    "indexer_logits_kernel|" + FP8_DENSE, "indexer_logits_kernel|" + FP8_PAGED,
    "indexer_fused_kernel|" + FP8_DENSE, "indexer_fused_kernel|" + BF16_DENSE, "indexer_fused_kernel|" + FP8_PAGED,
    "sparse_mla_fma_kernelILi576E", "sparse_mla_fma_kernelILi512E", "sparse_mla_merge_kernel",
    "block_topk_kernel", "block_attn_kernel", "block_attn_merge_kernel",  # MiniMax-M3's block-sparse ops (issue 20)
] + SPARSE_MLA_MMA


def test_disassembly_parsed():
    ks = sass()
    assert len(ks) >= 20, sorted(ks)
    assert all(len(ops) > 10 for ops in ks.values())


@pytest.mark.parametrize("name", MMA_KERNELS)
def test_tensor_cores(name):
    assert count(kernel(name), "HMMA") > 0


@pytest.mark.parametrize("name", NO_LOCAL)
def test_no_local_memory(name):
    ops = kernel(name)
    assert count(ops, "LDL", "STL") == 0, [op for op in ops if op.startswith(("LDL", "STL"))]


@pytest.mark.parametrize("name", SPARSE_MLA_ALIGNED)
def test_sparse_mla_aligned_staging_has_no_byte_loads(name):
    ops = kernel(name)
    byte_loads = [op for op in ops if op.startswith("LDG") and (".U8" in op or ".S8" in op)]
    assert byte_loads == []
    assert count(ops, "LDG.E.128") > 0  # q in 16-byte pieces


@pytest.mark.parametrize("name", SPARSE_MLA_ALIGNED)
def test_sparse_mla_aligned_staging_is_cp_async(name):
    # KV tiles (bf16 rows, raw fp8_ds_mla rows) are copied with cp.async.cg 16 B (LDGSTS), the
    # next tile in flight during the current one; fp8 pairs are converted by
    # cvt.rn.f16x2.e4m3x2 (F2FP.F16.E4M3.UNPACK_B on sm_90a), then f16 -> fp32 (HADD2.F32).
    ops = kernel(name)
    assert count(ops, "LDGSTS") > 0
    assert count(ops, "LDGDEPBAR") > 0 and count(ops, "DEPBAR") > 0  # commit_group, wait_group
    assert count(ops, "F2FP.F16.E4M3.UNPACK_B") > 0


@pytest.mark.parametrize("name", SPARSE_MLA_V4_ALIGNED)
def test_sparse_mla_v4_aligned_staging_is_cp_async(name):
    # d_qk 512 (DeepSeek-V4): bf16 rows by cp.async 16 B only; q in 16-byte pieces; no byte loads.
    ops = kernel(name)
    assert count(ops, "LDGSTS") > 0 and count(ops, "LDG.E.128") > 0
    assert [op for op in ops if op.startswith("LDG") and (".U8" in op or ".S8" in op)] == []


@pytest.mark.parametrize("name", SPARSE_MLA_V4_BYTES)
def test_sparse_mla_v4_byte_fallback_is_separate(name):
    # The misaligned d_qk 512 instantiations stage with 16-bit loads and no cp.async.
    ops = kernel(name)
    assert count(ops, "LDGSTS") == 0
    assert any(op.startswith("LDG") and ".U16" in op for op in ops)


@pytest.mark.parametrize("name", SPARSE_MLA_BYTES)
def test_sparse_mla_byte_fallback_is_separate(name):
    # The misaligned-cache instantiations keep the byte-safe loads; the check above would be
    # vacuous if both instantiations had folded into one without them.
    ops = kernel(name)
    assert any(op.startswith("LDG") and ".U8" in op for op in ops)


# ------------------------------------------------------------------ issue 12: indexer and top-k

INDEXER_MMA = [n for n in MMA_KERNELS if n.startswith("indexer_")]
FP8_INDEXER = [n for n in INDEXER_MMA if "|Ih" in n]
BF16_INDEXER = [n for n in INDEXER_MMA if "|It" in n]
INDEXER_FP32 = ["indexer_logits_kernel|IfLb0ELb0ELb0ELb0E", "indexer_fused_kernel|IfLb0ELb0ELb0ELb0E"]


@pytest.mark.parametrize("name", INDEXER_MMA)
def test_indexer_fragments_by_ldmatrix(name):
    # Per head tile: 8 ldmatrix.x4 for q (A); per key tile: 16 for the warp's 32 keys (B).
    ops = kernel(name)
    assert count(ops, "LDSM") >= 24, [op for op in ops if op.startswith("LDSM")]


@pytest.mark.parametrize("name", FP8_INDEXER)
def test_fp8_indexer_converts_in_hardware_and_runs_f16_mma(name):
    # sm_90a: e4m3 pairs -> f16 pairs (cvt.rn.f16x2.e4m3x2 is F2FP.F16.E4M3.UNPACK_B) and the
    # f16 mma (HMMA.16816.F32, no .BF16); four mma per q fragment, 8 k-steps: 32 in the loop.
    ops = kernel(name)
    assert count(ops, "F2FP.F16.E4M3.UNPACK_B") > 0
    assert ops.count("HMMA.16816.F32") >= 32
    assert count(ops, "HMMA.16816.F32.BF16") == 0


@pytest.mark.parametrize("name", BF16_INDEXER)
def test_bf16_indexer_runs_bf16_mma(name):
    ops = kernel(name)
    assert ops.count("HMMA.16816.F32.BF16") >= 32
    assert count(ops, "F2FP.F16.E4M3.UNPACK_B") == 0


@pytest.mark.parametrize("name", INDEXER_MMA + INDEXER_FP32 + ["topk_persistent_kernel", "topk_zero_kernel"])
def test_no_local_memory_indexer_and_persistent_topk(name):
    ops = kernel(name)
    assert count(ops, "LDL", "STL") == 0, [op for op in ops if op.startswith(("LDL", "STL"))]


# ------------------------------------------------------------------ issue 25: the indexer's cp.async key ring

INDEXER_WGMMA = [f"indexer_{kind}_kernel|{frag}" for kind in ("logits", "fused") for frag in WGMMA]
INDEXER_ALIGNED = [f"indexer_{kind}_kernel|{frag}" for kind in ("logits", "fused")
                   for frag in [FP8_DENSE, BF16_DENSE, FP8_PAGED] + PADDED] + INDEXER_WGMMA
INDEXER_MISALIGNED = [f"indexer_{kind}_kernel|{frag}" for kind in ("logits", "fused") for frag in MISALIGNED]


@pytest.mark.parametrize("name", INDEXER_ALIGNED)
def test_indexer_aligned_staging_is_cp_async(name):
    # Key rows and their fp32 scales (dense and paged 132-byte rows) are copied by cp.async.cg
    # 16 B (LDGSTS) into the shared-memory ring (commit_group = LDGDEPBAR, wait_group = DEPBAR);
    # no per-byte global loads (the paged scales were read byte by byte, LDG.E.U8, before).
    ops = kernel(name)
    byte_loads = [op for op in ops if op.startswith("LDG") and (".U8" in op or ".S8" in op)]
    assert byte_loads == []
    assert count(ops, "LDGSTS") > 0
    assert count(ops, "LDGDEPBAR") > 0 and count(ops, "DEPBAR") > 0


@pytest.mark.parametrize("name", INDEXER_MISALIGNED)
def test_indexer_misaligned_fallback_is_separate(name):
    # The misaligned instantiations stage synchronously (no cp.async); fp8 ones keep byte loads.
    # Without them the checks above would be vacuous (one kernel serving both).
    ops = kernel(name)
    assert count(ops, "LDGSTS") == 0
    if "|Ih" in name:
        assert any(op.startswith("LDG") and ".U8" in op for op in ops)


@pytest.mark.parametrize("name", INDEXER_WGMMA)
def test_indexer_wgmma_kernels_run_qgmma(name):
    # sm_90a fp8 warpgroup MMA: wgmma.mma_async m64n64k32 e4m3 x e4m3 -> fp32 is
    # QGMMA.64x64x32.F32.E4M3.E4M3 (one per k-step of 32: 4 for d = 128), fenced by
    # WARPGROUP.ARRIVE (wgmma.fence) and waited by WARPGROUP.DEPBAR (wait_group); shared-memory
    # writes reach the async proxy through FENCE.VIEW.ASYNC.S (fence.proxy.async). No mma.sync
    # and no ldmatrix: both operands are read from shared memory by descriptor.
    ops = kernel(name)
    assert count(ops, "QGMMA") >= 4
    assert all(op.startswith("QGMMA.64") for op in ops if op.startswith("QGMMA"))
    assert count(ops, "WARPGROUP.ARRIVE") > 0 and count(ops, "WARPGROUP.DEPBAR") > 0
    assert count(ops, "FENCE.VIEW.ASYNC.S") > 0
    assert count(ops, "HMMA") == 0 and count(ops, "LDSM") == 0
    assert count(ops, "LDL", "STL") == 0
