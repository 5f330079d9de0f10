#!/usr/bin/env bash
# One-shot GPU check (issue 6): build in place with this machine's torch, run the CUDA
# tests, run a small subset again under compute-sanitizer (memcheck, racecheck), measure
# the device's copy / bf16-matmul ceilings, run the op benchmark, print a summary table.
#
#   bash bench/gpu_check.sh            # from the repository root; logs go to $OUT
#
# Written for the lent H200 (torch 2.11 + CUDA 13, Python 3.12, no internet) and kept under
# 8 minutes: every stage has a time cap, and stages are skipped when the budget runs out.
# Exactly 8 files land in $OUT (the device tool returns at most 8):
#   build.log test.log memcheck.log racecheck.log bench.log bench_cuda.json ceilings.json summary.txt
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
BUDGET="${GPU_CHECK_BUDGET_S:-465}"  # seconds for all stages
START=$(date +%s)
declare -a ROWS=()

left() { echo $((BUDGET - ($(date +%s) - START))); }

# stage NAME CAP_S LOG CMD...: runs CMD with a time cap (trimmed to the budget left), logs
# to $OUT/LOG (appending), records status and seconds.
stage() {
  local name=$1 cap=$2 log=$3
  shift 3
  local remain
  remain=$(left)
  if [ "$remain" -lt 20 ]; then
    ROWS+=("$name|skipped (budget)|0")
    echo "== $name: skipped, budget spent" | tee -a "$OUT/$log"
    return 0
  fi
  [ "$cap" -gt "$remain" ] && cap=$remain
  echo "== $name (cap ${cap}s): $*" | tee -a "$OUT/$log"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" >>"$OUT/$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0))
  local status="ok"
  [ $rc -ne 0 ] && status="FAILED rc=$rc"
  [ $rc -eq 124 ] && status="TIMEOUT ${cap}s"
  ROWS+=("$name|$status|$dt")
  echo "== $name: $status in ${dt}s" | tee -a "$OUT/$log"
  return $rc
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())" 2>&1
  command -v nvcc compute-sanitizer ncu nsys 2>&1 || true
} >"$OUT/build.log"

# 1. Build in place against this machine's torch. Hopper only (the portable PTX target is
#    compile-checked in CI); INDEXCACHE_CUDA=1 makes a build without kernels an error.
stage build 240 build.log env INDEXCACHE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" \
  MAX_JOBS="${MAX_JOBS:-16}" "$PY" -m pip install --no-build-isolation --no-deps -v -e .
BUILD_OK=$?
if [ $BUILD_OK -eq 0 ]; then
  "$PY" -c "import indexcache, json; print(json.dumps(indexcache.build_info()))" >>"$OUT/build.log" 2>&1
fi

# 2. The device-parametrized tests, cuda cases only.
TESTS="tests/test_ops.py tests/test_buffer.py tests/test_cuda_graph.py tests/test_cuda_checks.py tests/test_hy_v4_device.py tests/test_block_sparse.py"
if [ $BUILD_OK -eq 0 ]; then
  stage tests 110 test.log "$PY" -m pytest -q -rfE -p no:cacheprovider $TESTS -k cuda
else
  ROWS+=("tests|skipped (no build)|0")
fi

# 2b. The indexer's sm_90a fp8 warpgroup-MMA kernels (opt-in: INDEXCACHE_WGMMA=1) on the same
#     indexer tests: accuracy bars and the fused == topk_indices(logits) checks (issue 25).
if [ $BUILD_OK -eq 0 ]; then
  stage wgmma 60 test.log env INDEXCACHE_WGMMA=1 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/test_ops.py \
    -k "cuda and indexer"
else
  ROWS+=("wgmma|skipped (no build)|0")
fi

# 3. Sanitizers on small shapes. No caching allocator, so that every tensor is its own
#    allocation and memcheck sees an access one past its end.
SMALL='cuda and not portable and (test_quantize_fp8 or test_index_k_cache_insert or test_mla_kv_cache_insert or test_positions_to_slots or (test_indexer_logits and 7-300 and fp8) or test_indexer_logits_paged or test_topk_windows_and_ties or (test_topk_tie_free and 5-1000) or (test_indexer_topk_fused and 6-200 and fp8) or test_indexer_topk_paged or (test_sparse_mla and 3-16-64) or test_fill_topk_buffer or (test_topk_long_rows and 65536) or test_sparse_mla_few_rows_split_keys or (test_sparse_mla_sinks and 3-16-64) or test_sparse_mla_sinks_few_rows_split_keys or (test_sparse_mla_nonfinite_sinks and 1100) or (test_block_topk_cuda and 4-128-16) or test_block_topk_paged_cuda or (test_block_sparse_attention_cuda and 8-2-128) or test_block_sparse_attention_non_finite_cuda)'
if [ $BUILD_OK -eq 0 ] && command -v compute-sanitizer >/dev/null 2>&1; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  stage memcheck 100 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 30 \
    --target-processes all "$PY" -m pytest -q -x -p no:cacheprovider $TESTS -k "$SMALL"
  stage racecheck 90 racecheck.log compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 30 \
    --target-processes all "$PY" -m pytest -q -x -p no:cacheprovider $TESTS -k "$SMALL"
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
else
  ROWS+=("memcheck|skipped (no build or no compute-sanitizer)|0" "racecheck|skipped|0")
fi

# 4. Device ceilings, measured in this run: a large device copy and a large bf16 matmul.
cat >"$OUT/.ceilings.py" <<'EOF'
import json, sys, torch
torch.manual_seed(0)
def bench(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3
src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
t = bench(lambda: dst.copy_(src), 10)
copy_tbs = 2 * src.numel() / t / 1e12
n = 8192
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
t = bench(lambda: x @ y, 10)
mm_tflops = 2 * n**3 / t / 1e12
res = {"device": torch.cuda.get_device_name(), "copy_tb_per_s": copy_tbs, "bf16_matmul_tflop_per_s": mm_tflops}
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(res)
EOF
if [ $BUILD_OK -eq 0 ]; then
  stage ceilings 40 bench.log "$PY" "$OUT/.ceilings.py" "$OUT/ceilings.json"
  # 5. The op benchmark: ours vs the reference path and torch.topk.
  stage bench 150 bench.log "$PY" bench/bench_ops.py --device cuda --ops topk,k_cache,indexer,mla --json "$OUT/bench_cuda.json"
  # MiniMax-M3's block-sparse ops (issue 20: first run of their CUDA kernels; table in bench.log).
  stage bs_bench 60 bench.log "$PY" bench/bench_ops.py --device cuda --ops block_sparse --quick
  # The decode step: eager vs sync-free static vs the replayed CUDA graph (table in bench.log).
  stage decode 60 bench.log "$PY" bench/bench_decode_step.py --device cuda --repeat 3
  # Sparse MLA with attention sinks (HY-V4, issue 19): its tests on the GPU (the mma kernel with
  # and without the split merge, the FMA kernel, NaN / +-inf sinks, -inf = no sink to the bit),
  # then its cost against the sink-free call, interleaved (table in bench.log; expect ~1.0x).
  stage sinks 60 test.log "$PY" -m pytest -q -rfE -p no:cacheprovider tests/test_ops.py -k "cuda and sinks"
  stage sinks_bench 50 bench.log "$PY" bench/bench_ops.py --device cuda --ops mla --sinks --repeat 5
fi
rm -f "$OUT/.ceilings.py"

# 6. Side by side with the peers on the issue's shapes, in this run: FlashMLA's sparse
#    prefill / decode, DeepGEMM's fp8_mqa_logits / fp8_paged_mqa_logits (sgl-deep-gemm 0.2.5:
#    fp8_fp4_*) against our indexer on 64 rows x 64 heads x 128K keys and on paged decode
#    batches (1 / 8 / 64 x 128K, 32 x 2 x 32K), with TFLOP/s and the ratio, torch.topk. The
#    GPU machine has no internet: download the wheels where there is one and carry them
#    (build/ is git-ignored: pass carry=["build/peer_wheels"] to the device tool; 15 MB)
#    (docs/profiling.md):  pip download --no-deps -d build/peer_wheels sgl-flash-mla sgl-deep-gemm
#    A peer is timed only when it imports; a peer call that fails is reported, not fatal.
PEER_WHEELS="${PEER_WHEELS:-build/peer_wheels}"
PEERS_JSON=$(mktemp /tmp/ic_peers.XXXXXX)
if [ $BUILD_OK -eq 0 ]; then
  if ls "$PEER_WHEELS"/*.whl >/dev/null 2>&1; then
    stage peer_pip 60 bench.log "$PY" -m pip install --no-deps --no-index "$PEER_WHEELS"/*.whl
  fi
  stage peers 120 bench.log "$PY" bench/peers_check.py --json "$PEERS_JSON"
fi

# 7. Summary (also written to summary.txt).
{
  echo
  echo "================ gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - START))s) ================"
  head -3 "$OUT/build.log"
  printf '%-10s %-34s %6s\n' stage status seconds
  for r in "${ROWS[@]}"; do
    IFS='|' read -r n s d <<<"$r"
    printf '%-10s %-34s %6s\n' "$n" "$s" "$d"
  done
  echo
  echo "tests:     $(grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)' "$OUT/test.log" 2>/dev/null | tail -2 | head -1)"
  echo "wgmma:     $(grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)' "$OUT/test.log" 2>/dev/null | tail -1) (INDEXCACHE_WGMMA=1, indexer tests)"
  echo "memcheck:  $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" 2>/dev/null | tail -1) $(grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)' "$OUT/memcheck.log" 2>/dev/null | tail -1)"
  echo "racecheck: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" 2>/dev/null | tail -1) $(grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)' "$OUT/racecheck.log" 2>/dev/null | tail -1)"
  if [ -s "$OUT/bench_cuda.json" ]; then
    "$PY" - "$OUT/bench_cuda.json" "$OUT/ceilings.json" <<'EOF'
import json, sys
recs = json.load(open(sys.argv[1]))
try:
    ceil = json.load(open(sys.argv[2]))
except Exception:
    ceil = {}
tf, tb = ceil.get("bf16_matmul_tflop_per_s"), ceil.get("copy_tb_per_s")
if tf:
    print(f"ceilings:  bf16 matmul {tf:.0f} TFLOP/s, device copy {tb:.2f} TB/s (read + write)")
print(f"{'op':<20} {'shape':<26} {'ms':>9} {'baseline':<15} {'base ms':>9} {'x':>6}  rate")
for r in recs:
    rate = ""
    if "gflop_per_s" in r:
        rate = f"{r['gflop_per_s'] / 1e3:.1f} TFLOP/s" + (f" ({100 * r['gflop_per_s'] / 1e3 / tf:.0f}% of bf16 mm)" if tf else "")
    elif "gb_per_s" in r:
        rate = f"{r['gb_per_s'] / 1e3:.2f} TB/s" + (f" ({100 * r['gb_per_s'] / 1e3 / tb:.0f}% of copy)" if tb else "")
    print(f"{r['op']:<20} {r['shape']:<26} {r['ms']:>9.3f} {r['baseline']:<15} {r['baseline_ms']:>9.3f} {r['speedup']:>5.1f}x  {rate}")
EOF
  fi
  if [ -s "$PEERS_JSON" ]; then
    "$PY" bench/peers_check.py --print "$PEERS_JSON"
  fi
} 2>&1 | tee "$OUT/summary.txt"
rm -f "$PEERS_JSON"

for r in "${ROWS[@]}"; do
  case "$r" in *FAILED* | *TIMEOUT*) exit 1 ;; esac
done
exit 0
