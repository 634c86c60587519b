#!/usr/bin/env bash
# The whole GPU check in one go: builds (unless a carried build is there), runs the GPU tests
# and the benchmarks, prints a summary table. Run it on a machine with an NVIDIA GPU:
#   scripts/gpu_check.sh [tests] [bench] [nvlink] [scaling] [sweep] [nccl] [sanitize] [compare]
#   [megatron] [profile] [trace] [reads] [pytest] [all]   (default all, which leaves out sanitize,
#   compare, megatron, profile, trace and reads; pytest is the GPU pytest alone, part of tests;
#   nvlink, scaling and nccl need 2+ GPUs;
#   scaling sweeps the SM budget; sweep runs epx-bench's token and SM sweeps and plots them
#   (tools/plot_bench.py); nccl is the NCCL all-to-all baseline of the nvlink shapes; sanitize
#   runs compute-sanitizer memcheck over test_cuda_graph ht and ll, test_cuda_layout and a subset of
#   test_cuda_match (EPX_SANITIZE_CASES, indices as test_cuda_match takes them); compare runs
#   the bench shapes (2 SMs a rank where the SMs bind, then 16) on another build,
#   EPX_GPU_BUILD_BASE (a build, or a folder holding only a library), and this one, alternating
#   (EPX_COMPARE_SHAPES picks shapes, EPX_COMPARE_ROUNDS repeats them), and prints new / base
#   and GB/s per SM per phase (compare.txt; every run's JSON in compare.jsonl); megatron runs
#   Megatron-core's MoELayer on epx's CUDA backend, installing megatron-core from the carried
#   wheelhouse/ where this Python lacks it; profile runs Nsight Compute over the
#   high-throughput kernels and notify and sums each up with tools/ncu_hotspots.py; trace runs
#   the trace build of the library (src/cuda/trace.cuh) over notify's and the low-latency
#   shapes and sums up their phase times with tools/trace_phases.py; reads runs epx-sm-reads, how
#   fast one SM reads by bulk copies, loads and per-lane copies and writes by bulk and plain
#   stores, on 16 blocks and on every SM, and epx-latency, what a decode step's loads, fences,
#   atomics, barriers and flags cost)
# The benchmarks emulate an EP group on one GPU (the first visible one); the tests place rank r
# on GPU r % count, so on a machine with several GPUs they also cross NVLink.
# Logs go to $OUT (or ./gpu-check-out); a GPU pytest test that runs past 12 s leaves every
# thread's stacks there (stall-stacks.txt). Leaves the GPU's settings alone.
set -uo pipefail
cd "$(dirname "$0")/.."
what=" ${*:-all} "
want() { [[ $what == *" $1 "* || $what == *" all "* ]]; }
asked() { [[ $what == *" $1 "* ]]; } # sections that 'all' leaves out
out=${OUT:-gpu-check-out}
logs=$(mktemp -d)
mkdir -p "$out"
build=${EPX_GPU_BUILD:-build-gpu}
export NCCL_NVLS_ENABLE=0
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
export LD_LIBRARY_PATH="$PWD/$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
if [ ! -x "$build/epx-bench" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$out/build.log" 2>&1 && cmake --build "$build" -j >>"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; exit 1; }
fi

# GPUs this run may use: CUDA_VISIBLE_DEVICES's entries, else nvidia-smi's (MIG lines not counted)
gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
  else nvidia-smi -L 2>/dev/null | grep -c '^GPU '; fi
}
ngpu=$(gpus)

# test_cuda_match as $2 processes, each over every $2-th case; fails when any shard fails
match_shards() {
  local cases n=$2 pids=() rc=0 dir
  cases=$("$1/tests/gpu/test_cuda_match" --list | wc -l)
  dir=$(mktemp -d)
  for ((k = 0; k < n; k++)); do
    local sel=$(seq -s, "$k" "$n" $((cases - 1)))
    [ -n "$sel" ] && { "$1/tests/gpu/test_cuda_match" "$sel" >"$dir/$k.log" 2>&1 & pids+=($!); }
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$dir"/*.log
  return $rc
}

# Every thread of process $1, a line each, labelled $2: its state, system call and wait channel.
thread_states() { # pid, label
  for t in /proc/"$1"/task/*; do
    echo "$2: task ${t##*/} $(cat "$t/comm" 2>/dev/null) state $(awk '{print $3}' "$t/stat" 2>/dev/null)" \
      "syscall $(cut -d' ' -f1 "$t/syscall" 2>/dev/null) wchan $(cat "$t/wchan" 2>/dev/null)"
  done
}

# Runs a pytest command (its output into $1) and, when faulthandler reports a test still running
# after its timeout (pytest -o faulthandler_timeout), saves every thread's native stack too
# (gdb or cuda-gdb, where the machine has one) in $out/stall-stacks.txt: the Python stacks say
# which call a rank is in, the native ones whether it waits in CUDA, a loader or the kernel.
pytest_with_stacks() {
  local log=$1 dumped=0 dbg; shift
  dbg=$(command -v gdb || command -v cuda-gdb || true)
  "$@" >"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ $dumped = 0 ] && grep -q 'Timeout (0:' "$log"; then
      dumped=1
      local py
      py=$(pgrep -n -f 'python3 -m pytest')
      if [ -n "$dbg" ] && [ -n "$py" ]; then
        # symbols of libc, the CUDA driver and runtime and libepx only (the Python stacks name the
        # torch calls): reading every library's took long enough that the stalled test had ended
        timeout 60 "$dbg" -p "$py" -batch -iex 'set auto-solib-add off' -ex 'sharedlibrary libc\.' \
          -ex 'sharedlibrary libcuda' -ex 'sharedlibrary libcudart' -ex 'sharedlibrary libepx' \
          -ex 'info threads' -ex 'thread apply all bt 25' >"$out/stall-stacks.txt" 2>&1
      else
        echo "a test stalled; no debugger here for its native stacks" >"$out/stall-stacks.txt"
      fi
      # each thread's state and system call (a thread in the driver sits in ioctl, 16 on
      # x86-64; one spinning in user space is R with no call): readable without a debugger;
      # once more 5 s later, where the stall lasts
      if [ -n "$py" ]; then
        thread_states "$py" now >>"$out/stall-stacks.txt"
        sleep 5
        thread_states "$py" later >>"$out/stall-stacks.txt"
      fi
    fi
  done
  wait "$pid"
  local rc=$?
  # the stacks also at the end of the log (all.log): a caller that can take back only a few
  # files from $out keeps them
  [ $dumped = 1 ] && { echo "=== native stacks at the stall"; cat "$out/stall-stacks.txt"; } >>"$log"
  return $rc
}

summary=()
run() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s %-6s %4ds' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)))")
  { echo "=== $name"; cat "$logs/$name.log"; } >>"$out/all.log"
  tail -5 "$logs/$name.log"
  return $rc
}

if want tests; then
  run test_cuda_faults timeout 180 "$build/tests/gpu/test_cuda_faults"
  run test_cuda_notify timeout 180 "$build/tests/gpu/test_cuda_notify"
  run test_cuda_layout timeout 120 "$build/tests/gpu/test_cuda_layout"
  for mode in ht ll ll-split; do
    run "test_cuda_graph_$mode" timeout 180 "$build/tests/gpu/test_cuda_graph" "$mode"
  done
  run test_cuda_graph_ll_1000 timeout 300 "$build/tests/gpu/test_cuda_graph" ll 1000
  # the cases in EPX_MATCH_SHARDS processes at once (default 8; case i in shard i mod n): most
  # of a case's time is its host reference on one CPU core
  run test_cuda_match timeout 420 bash -c "$(declare -f match_shards); match_shards $build ${EPX_MATCH_SHARDS:-8}"
  # one rank per process (CUDA IPC), rank r on GPU r % count, against the host backend; with
  # several GPUs also every process on the first one (the driver time-slices their contexts)
  run test_cuda_mp timeout 240 "$build/tests/gpu/test_cuda_mp"
  if [ "$ngpu" -ge 2 ]; then
    first=${CUDA_VISIBLE_DEVICES:-0}
    run test_cuda_mp_one_gpu env CUDA_VISIBLE_DEVICES=${first%%,*} timeout 240 "$build/tests/gpu/test_cuda_mp"
  fi
fi
# the Python package on CUDA tensors (torch), against the CPU backend and dense references
# (also alone: 'pytest'). faulthandler prints every thread's Python stack when a test runs past
# 12 s (none should: the collectives' timeout is 20 s); pytest_with_stacks adds the native stacks
if want tests || asked pytest; then
  run pytest-gpu bash -c "$(declare -f thread_states pytest_with_stacks); out=$out; pytest_with_stacks $logs/pytest-gpu.raw \
    env EPX_LIBRARY=$PWD/$build/libepx.so EPX_TEST_REPEAT=6 timeout 300 python3 -m pytest -q -p no:cacheprovider \
    -o faulthandler_timeout=12 -m 'gpu and not megatron' tests/python; rc=\$?; cat $logs/pytest-gpu.raw; exit \$rc"
fi
if want tests; then
  run example-prefill-decode env EPX_LIBRARY="$PWD/$build/libepx.so" PYTHONPATH=python timeout 120 python3 examples/prefill_decode.py
fi

if want bench; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  b="env CUDA_VISIBLE_DEVICES=${first%%,*} $build/epx-bench --backend cuda --json"
  run bench-default-check   $b --check
  run bench-ds3-token       $b --tokens 4096 --iters 10 --check
  run bench-ds3-expert      $b --tokens 4096 --iters 10 --layout expert --align 128 --check
  run bench-ds3-fp8         $b --tokens 4096 --iters 10 --dtype fp8 --layout expert --align 128 --check
  run bench-ds3-a2a         $b --tokens 4096 --iters 10 --layout expert --align 128 --mode a2a --check
  # 32k prefill in the token layout: the baseline's send, staging and return buffers in the
  # expert layout would need ~22 GB per rank, more than 8 ranks can have on one H200. The
  # token layout's arena holds a few MiB: 1.5 GB a rank, not the default's 5, lets 8 ranks and
  # the benchmark's buffers fit an 80 GB GPU
  a32="env EPX_ARENA_MB=${EPX_ARENA_MB:-1536}"
  run bench-prefill32k      $a32 $b --tokens 32768 --iters 5
  run bench-prefill32k-fp8  $a32 $b --tokens 32768 --iters 5 --dtype fp8
  run bench-prefill32k-a2a  $b --tokens 32768 --iters 5 --mode a2a
  # the expert layout's combine keeps ~3.8 GB of partials a rank in its arena (4 GB a rank):
  # with the stand-in's outputs over recv_x, 8 ranks need about 73 GB in bf16 (estimated from the
  # buffers; it ran on an 80 GB H100 on 2026-12-07). fp8 keeps y (bf16) apart from its fp8 rows:
  # about 88 GB, an H200's but not an H100's
  a32e="env EPX_ARENA_MB=${EPX_ARENA_MB:-4096}"
  run bench-prefill32k-expert $a32e $b --tokens 32768 --iters 5 --layout expert --align 128
  if (($(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${first%%,*}") > 100000)); then
    run bench-prefill32k-expert-fp8 $a32e $b --tokens 32768 --iters 5 --dtype fp8 --layout expert --align 128
  fi
  # where the SMs bind (2 per rank, 16 in all): bytes per SM-second against the copy kernels
  run bench-sm2-token       $b --tokens 4096 --iters 10 --num-sms 2 --check
  run bench-sm2-expert      $b --tokens 4096 --iters 10 --num-sms 2 --layout expert --align 128 --check
  run bench-sm2-fp8         $b --tokens 4096 --iters 10 --num-sms 2 --dtype fp8 --layout expert --align 128 --check
  run bench-ep2-sm8         $b --ranks 2 --tokens 4096 --iters 10 --num-sms 8 --check
  # the per-token dispatch the pipelined one replaced on sm_90, same run
  run bench-ds3-token-per-token env EPX_HT_PIPELINED=0 $b --tokens 4096 --iters 10
  run bench-ll128           $b --tokens 128 --iters 50 --mode ll --graph --check
  # the low-latency targets' two-rank shapes: a decode step of 128 tokens, and of one
  run bench-ll128-ep2       $b --ranks 2 --tokens 128 --iters 50 --mode ll --graph --check
  run bench-ll1-ep2         $b --ranks 2 --tokens 1 --iters 50 --mode ll --graph --check
  run bench-ll128-fp8       $b --tokens 128 --iters 50 --mode ll --dtype fp8 --graph --check
  run bench-ll128-ht        $b --tokens 128 --iters 50 --layout expert --graph --check
fi

# Several GPUs: one rank per GPU through NVLink, and the NCCL all-to-all baseline of
# the same shape (one process per GPU).
if want nvlink && [ "$ngpu" -ge 2 ]; then
  b="$build/epx-bench --backend cuda --json --ranks $ngpu"
  run "nvlink-ds3-expert-ep$ngpu"  $b --tokens 4096 --iters 10 --layout expert --align 128 --check
  run "nvlink-ds3-token-ep$ngpu"   $b --tokens 4096 --iters 10 --check
  run "nvlink-ds3-fp8-ep$ngpu"     $b --tokens 4096 --iters 10 --dtype fp8 --layout expert --align 128
  run "nvlink-prefill32k-ep$ngpu"  $b --tokens 32768 --iters 5 --layout expert --align 128
  run "nvlink-ll128-ep$ngpu"       $b --tokens 128 --iters 50 --mode ll --graph --check
fi
# How the fused and low-latency paths scale with their SM budget (one rank per GPU): a phase
# whose time halves with twice the SMs is bound by the SMs' own memory traffic, not the link.
if want scaling && [ "$ngpu" -ge 2 ]; then
  b="$build/epx-bench --backend cuda --json --ranks $ngpu"
  for sms in 8 16 32 64; do
    run "scaling-expert-sms$sms" $b --tokens 4096 --iters 10 --layout expert --align 128 --num-sms $sms
    run "scaling-token-sms$sms"  $b --tokens 4096 --iters 10 --num-sms $sms
    run "scaling-ll128-sms$sms"  $b --tokens 128 --iters 50 --mode ll --graph --num-sms $sms
  done
  run "scaling-ll128-sms132" $b --tokens 128 --iters 50 --mode ll --graph --num-sms 132
fi
# The README's picture: bandwidth against tokens per rank (fused token and expert layout, the
# all-to-all baseline) and bytes per SM-second against SMs per rank, emulated on the first GPU;
# the JSON lands in $out/sweep, the PNG next to it (plotted here when matplotlib is installed,
# else plot the JSON on any machine with the command printed).
if want sweep; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  b="env CUDA_VISIBLE_DEVICES=${first%%,*} $build/epx-bench --backend cuda --iters 5"
  sw="$out/sweep"
  mkdir -p "$sw"
  run sweep-tokens-token  $b --sweep tokens --tokens 32768 --json "$sw/tokens-token.json"
  run sweep-tokens-expert $b --sweep tokens --tokens 16384 --layout expert --align 128 --json "$sw/tokens-expert.json"
  # the baseline's buffers in the expert layout outgrow one H200's memory past 16k tokens (8 ranks)
  run sweep-tokens-a2a    $b --sweep tokens --tokens 16384 --layout expert --align 128 --mode a2a --json "$sw/tokens-a2a.json"
  run sweep-sms-token     $b --sweep sms --tokens 4096 --json "$sw/sms-token.json"
  run sweep-sms-expert    $b --sweep sms --tokens 4096 --layout expert --align 128 --json "$sw/sms-expert.json"
  # the device's copy of the tree may carry no (or a stale) .git: name the commit with EPX_COMMIT
  plot="python3 tools/plot_bench.py --title \"$(date -u +%Y-%m-%d)${EPX_COMMIT:+, commit $EPX_COMMIT}\" --out $sw/bench.png $sw/*.json"
  echo "$plot" >"$sw/plot-command.txt"
  run sweep-plot bash -c "$plot" || echo "plot the sweep elsewhere: $plot"
fi
# compute-sanitizer's memcheck over the shapes the tests check: every buffer a peer touches is
# plain device memory registered at set-up, so the tool follows every access
if asked sanitize; then
  cs="env EPX_TEST_TIMEOUT_MS=120000 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20"
  run sanitize-graph-ht timeout 240 $cs "$build/tests/gpu/test_cuda_graph" ht 3
  run sanitize-graph-ll timeout 240 $cs "$build/tests/gpu/test_cuda_graph" ll 3
  run sanitize-layout timeout 240 $cs "$build/tests/gpu/test_cuda_layout"
  run sanitize-match timeout 300 $cs "$build/tests/gpu/test_cuda_match" ${EPX_SANITIZE_CASES:-2,4,7,15,20,21,25,30}
fi
# The same bench shapes on two builds, alternating, so drift of the GPU's clocks hits both
if asked compare && [ -n "${EPX_GPU_BUILD_BASE:-}" ]; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  base=$EPX_GPU_BUILD_BASE
  shapes=("--tokens 4096 --iters 10 --num-sms 2" "--tokens 4096 --iters 10 --num-sms 2 --layout expert --align 128"
          "--tokens 4096 --iters 10" "--tokens 4096 --iters 10 --layout expert --align 128"
          "--tokens 4096 --iters 10 --dtype fp8 --layout expert --align 128"
          "--tokens 4096 --iters 10 --layout expert --align 128 --mode a2a" "--tokens 32768 --iters 5"
          "--tokens 128 --iters 50 --mode ll --graph" "--tokens 128 --iters 50 --mode ll --dtype fp8 --graph"
          "--ranks 2 --tokens 128 --iters 50 --mode ll --graph" "--ranks 2 --tokens 1 --iters 50 --mode ll --graph"
          "--ranks 1 --tokens 4096 --iters 20")
  # EPX_COMPARE_SHAPES: the shapes' indices to run (default every one); EPX_COMPARE_ROUNDS: how
  # often each pair runs (default 1). A base folder with only a library runs this build's benchmark.
  pick=${EPX_COMPARE_SHAPES:-${!shapes[*]}} rounds=${EPX_COMPARE_ROUNDS:-1}
  base_bench=$base/epx-bench
  [ -x "$base_bench" ] || base_bench=$build/epx-bench
  for ((k = 0; k < rounds; k++)); do
    for i in $pick; do
      run "compare-base-$i-$k" env CUDA_VISIBLE_DEVICES=${first%%,*} LD_LIBRARY_PATH="$PWD/$base" \
        "$base_bench" --backend cuda --json ${shapes[$i]}
      run "compare-new-$i-$k" env CUDA_VISIBLE_DEVICES=${first%%,*} "$build/epx-bench" --backend cuda --json ${shapes[$i]}
    done
  done
  python3 - "$logs" "$rounds" "$out/compare.jsonl" $pick <<'PY' | tee "$out/compare.txt"
import json, statistics, sys
logs, rounds, keep, picked = sys.argv[1], int(sys.argv[2]), sys.argv[3], [int(i) for i in sys.argv[4:]]
def run(name):
    try:
        for line in open(f"{logs}/{name}.log"):
            if line.startswith("{"):
                return json.loads(line)
    except OSError:
        return None
def span(v, fmt):
    return fmt % v[0] if len(v) == 1 else (fmt + "-" + fmt) % (min(v), max(v))
print(f"{'shape':44} {'phase':9} {'base ms':>15} {'new ms':>15} {'new/base':>8} {'GB/s/SM base':>12} {'new':>6}")
runs = {(side, i, k): run(f"compare-{side}-{i}-{k}") for side in ("base", "new") for i in picked for k in range(rounds)}
with open(keep, "w") as f:  # every run's whole JSON (each rank's part of a phase too), tagged
    for (side, i, k), r in runs.items():
        if r: f.write(json.dumps({"compare": side, "shape": i, "round": k, **r}) + "\n")
for i in picked:
    bs = [r for r in (runs["base", i, k] for k in range(rounds)) if r]
    cs = [r for r in (runs["new", i, k] for k in range(rounds)) if r]
    if not bs or not cs:
        print(f"shape {i}: no result"); continue
    c = cs[0]
    shape = f"R={c['ranks']} {c['mode']} {c['layout']} {c['recv_dtype']} T={c['tokens']} sms={c.get('sms_in_use', '?')}"
    for ph in ("notify", "dispatch", "combine"):
        b_ms = [r[ph + "_ms"] for r in bs if r.get(ph + "_ms")]
        c_ms = [r[ph + "_ms"] for r in cs if r.get(ph + "_ms")]
        if b_ms and c_ms:
            ratio = statistics.median(c_ms) / statistics.median(b_ms)
            per_sm = f"{statistics.median(r.get(ph + '_gbps_per_sm', 0) for r in bs):12.1f} " \
                     f"{statistics.median(r.get(ph + '_gbps_per_sm', 0) for r in cs):6.1f}"
            print(f"{shape:44} {ph:9} {span(b_ms, '%.4f'):>15} {span(c_ms, '%.4f'):>15} {ratio:8.3f} {per_sm}")
PY
fi
# Nsight Compute over the high-throughput kernels and notify, one report each in $out/profile
# with its source page (CSV) and tools/ncu_hotspots.py's summary of it. One rank: the profiler
# runs kernels one at a time, and an emulated group's kernels wait on each other. Top-2 routing
# with align 1 gives each token the rows per rank an 8-rank DeepSeek-V3 step gives (1.5-2), and
# the kernels there run at the 8-rank step's speed per SM.
if asked profile; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  pd="$out/profile"
  mkdir -p "$pd"
  shape="--ranks 1 --num-sms 2 --tokens 8192 --iters 2 --topk 2 --layout expert --align 1"
  profiles=("fp8-dispatch|dispatch_staged_kernel|$shape --dtype fp8" "bf16-dispatch|dispatch_bulk_kernel|$shape"
            "partials|partials_token_kernel|$shape" "reduce|reduce_token_kernel|$shape"
            "notify-32k|notify_kernel|--ranks 1 --tokens 32768 --iters 2")
  for p in "${profiles[@]}"; do
    IFS='|' read -r name kernel flags <<<"$p"
    run "profile-$name" env CUDA_VISIBLE_DEVICES=${first%%,*} timeout 300 ncu --set full --kernel-name "regex:$kernel" \
      --launch-skip 1 --launch-count 1 -f -o "$pd/$name" "$build/epx-bench" --backend cuda $flags
    ncu -i "$pd/$name.ncu-rep" --page source --csv --print-source sass >"$pd/$name.csv" 2>/dev/null &&
      python3 tools/ncu_hotspots.py "$pd/$name.csv" >"$pd/$name-hotspots.txt" && head -4 "$pd/$name-hotspots.txt"
    ncu -i "$pd/$name.ncu-rep" --page details >"$pd/$name-details.txt" 2>/dev/null
  done
fi
# Phase times: the library built again with -DEPX_LL_TRACE -DEPX_NOTIFY_TRACE (into
# $EPX_GPU_TRACE_BUILD, default build-trace: carry it to skip the build), run by this build's
# benchmark for notify's and the low-latency shapes; tools/trace_phases.py sums each up (us,
# min / median / max, the warm-up launch dropped) into $out/trace-<shape>.txt.
if asked trace; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  tb=${EPX_GPU_TRACE_BUILD:-build-trace}
  if [ ! -f "$tb/libepx.so" ]; then
    cmake -S . -B "$tb" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CUDA_FLAGS=-DEPX_LL_TRACE -DEPX_NOTIFY_TRACE" \
      >"$out/trace-build.log" 2>&1 && cmake --build "$tb" -j --target epx >>"$out/trace-build.log" 2>&1 \
      || { tail -30 "$out/trace-build.log"; exit 1; }
  fi
  traces=("notify-1x4096|--ranks 1 --tokens 4096 --iters 5" "notify-8x4096|--ranks 8 --tokens 4096 --iters 5"
          "notify-8x32768|--ranks 8 --tokens 32768 --iters 2" "ll-2x1|--ranks 2 --tokens 1 --mode ll --graph --iters 20"
          "ll-2x128|--ranks 2 --tokens 128 --mode ll --graph --iters 20"
          "ll-8x128|--ranks 8 --tokens 128 --mode ll --graph --iters 20")
  for p in "${traces[@]}"; do
    IFS='|' read -r name flags <<<"$p"
    run "trace-$name" env CUDA_VISIBLE_DEVICES=${first%%,*} LD_LIBRARY_PATH="$PWD/$tb" timeout 120 \
      "$build/epx-bench" --backend cuda $flags
    python3 tools/trace_phases.py --skip 1 "$logs/trace-$name.log" | tee "$out/trace-$name.txt"
  done
fi
# How fast one SM reads memory, each way a kernel can read it (tools/sm_reads.cu): on 16 blocks,
# where the SMs bind, and on every SM, where HBM does; then what each step of a decode kernel
# costs one thread (tools/latency.cu).
if asked reads; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  run reads-16 env CUDA_VISIBLE_DEVICES=${first%%,*} timeout 120 "$build/epx-sm-reads" 16
  run reads-every-sm env CUDA_VISIBLE_DEVICES=${first%%,*} timeout 120 "$build/epx-sm-reads" 0
  cat "$logs"/reads-*.log >"$out/sm-reads.txt"
  run latency env CUDA_VISIBLE_DEVICES=${first%%,*} timeout 120 "$build/epx-latency"
  cp "$logs/latency.log" "$out/latency.txt"
fi
# Megatron-core's own MoELayer with the flex dispatcher (deepep and hybridep) on epx's CUDA
# backend against Megatron's alltoall, bf16, 8 layers in flight, every rank's process on the
# first GPU (tests/python/test_megatron_dropin.py, marked gpu); prints the memory a layer holds
# in flight. megatron-core comes from wheelhouse/ (ci/install-megatron.sh --download where
# there is internet, then carry it): installed into .megatron-site, the machine's Python untouched.
# EPX_MEGATRON_K picks cases (pytest -k, e.g. ep2 or "ep4 and hybridep").
if asked megatron; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  site="$PWD/.megatron-site"
  mpath="$site${PYTHONPATH:+:$PYTHONPATH}"
  if ! PYTHONPATH="$mpath" python3 -c 'import megatron.core' 2>/dev/null; then
    run megatron-install timeout 120 sh ci/install-megatron.sh --offline python3 "$site"
  fi
  run megatron-dropin-gpu env CUDA_VISIBLE_DEVICES=${first%%,*} EPX_LIBRARY="$PWD/$build/libepx.so" PYTHONPATH="$mpath" \
    timeout 480 python3 -m pytest -q -s -rs -m gpu ${EPX_MEGATRON_K:+-k "$EPX_MEGATRON_K"} tests/python/test_megatron_dropin.py
  grep -h 'in flight holds' "$logs/megatron-dropin-gpu.log" | tee "$out/megatron-memory.txt" \
    || echo "megatron: no memory report (did the tests skip? see $out/all.log)"
fi
if want nccl && [ "$ngpu" -ge 2 ]; then
  run "nccl-ds3-ep$ngpu"     python3 -m torch.distributed.run --nproc-per-node "$ngpu" tools/nccl_baseline.py --tokens 4096 --iters 10
  run "nccl-prefill32k-ep$ngpu" python3 -m torch.distributed.run --nproc-per-node "$ngpu" tools/nccl_baseline.py --tokens 32768 --iters 5
fi

echo
echo "== summary =="
printf '%s\n' "${summary[@]}"
grep -h '^{' "$logs"/bench-*.log "$logs"/nvlink-*.log "$logs"/scaling-*.log "$logs"/nccl-*.log 2>/dev/null > "$out/bench.jsonl" || true
[ -d "$out/sweep" ] && echo "sweep: JSON and bench.png in $out/sweep"
# fused path against the all-to-all baseline, same shape (dispatch + combine)
python3 - "$out/bench.jsonl" <<'PY' || true
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
epx = [r for r in runs if "mode" in r]
key = lambda r: (r["ranks"], r["tokens"], r["layout"], r["recv_dtype"])
total = lambda r: r["dispatch_ms"] + r["combine_ms"]
for r in epx:
    if r["mode"] != "ht":
        continue
    for b in epx:
        if b["mode"] == "a2a" and key(b) == key(r):
            print(f"speedup over the all-to-all baseline, EP{r['ranks']} {r['tokens']} tokens/rank, {r['layout']}: "
                  f"{total(b) / total(r):.2f}x ({total(r):.3f} ms vs {total(b):.3f} ms, dispatch + combine)")
    for n in runs:
        if n.get("baseline", "").startswith("nccl") and (n["ranks"], n["tokens"]) == (r["ranks"], r["tokens"]) \
                and r["recv_dtype"] == "bfloat16":
            print(f"speedup over NCCL all-to-all, EP{r['ranks']} {r['tokens']} tokens/rank: {total(n) / total(r):.2f}x "
                  f"({total(r):.3f} ms vs {total(n):.3f} ms)")
PY
for f in "$logs"/bench-*.log "$logs"/nvlink-*.log "$logs"/scaling-*.log "$logs"/nccl-*.log; do
  [ -f "$f" ] || continue
  echo "-- $(basename "$f" .log)"
  grep -E '^(copy|dispatch|combine|notify|check|with a GPU|GB/s/SM|\{"baseline)' "$f"
done
# EPX_GPU_PACK=1: everything in $out also packed into one archive, gpu-check.tgz, the loose files
# removed (for a runner that brings back only a few files)
if [ -n "${EPX_GPU_PACK:-}" ]; then
  tar -czf "$logs/gpu-check.tgz" -C "$out" . && find "$out" -mindepth 1 -delete && mv "$logs/gpu-check.tgz" "$out/"
fi
