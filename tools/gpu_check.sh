#!/usr/bin/env bash
# The GPU check, in one command on a CUDA node (repository root; `make gpu-check`): the node's
# versions, `pytest -m gpu` (tests/gpu/test_gpu.py), then timed GPU runs of the benchmark jobs with
# nvidia-smi sampling the GPU's busy fraction. Every log goes to $OUT (default /tmp/gpu-check):
# info.txt, pytest.log, bench.log (each job's log and wall time), smi.csv. Under 8 minutes:
# every step has its own timeout, cut to what is left of GPU_CHECK_BUDGET_S (465 s) from the
# start, and a step that would get under 10 s is skipped (the steps run in order of priority).
# Needs no network: wheels the node lacks travel in .whl/ (tools/gpu_wheels.sh, run where pip
# works), Fashion-MNIST in .whl/data/ (the main job's data).
# GPU_CHECK_DEVICE=cpu: a dry run of the same steps on the CPU (every `cuda` becomes `cpu`, the
# GPU tests run on the CPU code paths), to check the script where there is no GPU.
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-465}
DEV=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
[ "$DEV" = cpu ] && export MPIFL_GPU_TEST_DEVICE=cpu
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }  # seconds of the budget left

# -- carried wheels (pip -e needs the network: the repository goes on PYTHONPATH instead) -----
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "gpu_check: installing .whl/ failed" >&2
  # pip --target drops a wheel's data/lib folder, where MPICH keeps libmpi (mpi4py loads it)
  for w in .whl/mpich-*.whl; do
    [ -e "$w" ] && "$PY" -m zipfile -e "$w" /tmp/mpich
  done
  for lib in /tmp/mpich/mpich-*.data/data/lib; do
    [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
  done
  export PATH="/tmp/site/bin:$PATH"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .whl/data ] && export MPIFL_DATA="$PWD/.whl/data"

# -- what this node is --------------------------------------------------------------------------
{
  date -u
  nvidia-smi || echo "nvidia-smi: not found"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| CUDA', torch.version.cuda, '| cuDNN', torch.backends.cudnn.version(),
'| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
  "$PY" -c "import mpifl, pydantic, h5py, numpy; print('mpifl', mpifl.__file__, '| pydantic',
pydantic.VERSION, '| h5py', h5py.__version__, '| numpy', numpy.__version__)"
  command -v mpiexec && mpiexec --version 2>&1 | head -3 || echo "mpiexec: not found"
  "$PY" -c "from mpi4py import MPI; print('mpi4py:', MPI.Get_library_version().splitlines()[0])" \
    2>&1 | tail -1
  nproc; free -g | head -2
} > "$OUT/info.txt" 2>&1
cat "$OUT/info.txt"

# -- nvidia-smi samples the GPU every 200 ms while the rest runs -------------------------------
SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 200 \
    > "$OUT/smi.csv" 2>&1 &
  SMI=$!
fi
mark() { echo "== $(date -u +%H:%M:%S.%N | cut -c1-12) $*" | tee -a "$OUT/smi-marks.txt"; }

# -- the tests ---------------------------------------------------------------------------------
mark "pytest -m gpu"
LIMIT=$(( $(left) < 200 ? $(left) : 200 )); [ "$LIMIT" -lt 10 ] && LIMIT=10
timeout "$LIMIT" "$PY" -m pytest -m gpu -q -p no:cacheprovider --durations=10 tests/gpu/test_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.log"
tail -25 "$OUT/pytest.log"

# -- benchmarks: each job's log and wall time in bench.log -------------------------------------
bench() {  # bench NAME SECONDS COMMAND...: at most SECONDS, and what the budget has left
  local name=$1 limit=$2; shift 2
  local rest; rest=$(left)
  [ "$rest" -lt "$limit" ] && limit=$rest
  if [ "$limit" -lt 10 ]; then
    echo "=== $name: skipped, ${rest} s of the ${BUDGET} s budget left" | tee -a "$OUT/bench.log"
    return
  fi
  mark "$name (at most $limit s)"
  { echo "=== $name: $*"; } >> "$OUT/bench.log"
  local t0; t0=$(date +%s.%N)
  timeout "$limit" "$@" >> "$OUT/bench.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc, wall $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }") s" \
    | tee -a "$OUT/bench.log"
}
RUNS=/tmp/gpu-check-runs
rm -rf "$RUNS"; mkdir -p "$RUNS"
COMMON=(--no-progress --overwrite --set server.device="$DEV" --set run.progress_every_s=5
        --set run.checkpoint_every=0)

# the main job (FedFV on Fashion-MNIST), 10 rounds: one process, then 3 ranks on one GPU
MAIN=(run jobs/fmnist-fedfv.toml "${COMMON[@]}" --set run.rounds=10 --set run.eval_every=5)
bench "main job, 1 process" 40 "$PY" -m mpifl "${MAIN[@]}" --out "$RUNS/main1.h5"
if command -v mpiexec >/dev/null; then
  bench "main job, 3 ranks" 45 mpiexec -n 3 "$PY" -m mpifl "${MAIN[@]}" --out "$RUNS/main3.h5"
fi
# the FEMNIST-shaped job (LEAF's CNN, 3550 writers; a stand-in of the data), 30 rounds
bench "leaf-femnist (femnist_like), 30 rounds" 50 "$PY" -m mpifl run jobs/leaf-femnist.toml \
  "${COMMON[@]}" --set data.dataset=femnist_like --set run.rounds=30 --set run.eval_every=30 \
  --out "$RUNS/femnist.h5"
# K = 10^6 lazy clients, 10^4 a round (FedAvg), 3 rounds, one sampled evaluation; then the same
# with the clients and their minibatch order drawn on the device (Synthetic's counter generator,
# data.params.generator = "counter", and client.minibatch_order = "counter": other data, other
# orders, so only the time is compared)
SCALE=(run jobs/scale-1m.toml "${COMMON[@]}" --set run.rounds=3 --set run.eval_every=3
       --set run.full_eval_every=0)
bench "scale-1m, 3 rounds" 60 "$PY" -m mpifl "${SCALE[@]}" --out "$RUNS/scale1m.h5"
bench "scale-1m, 3 rounds, counter generator and order" 50 "$PY" -m mpifl "${SCALE[@]}" \
  --set data.params.generator=counter --set client.minibatch_order=counter \
  --out "$RUNS/scale1m-counter.h5"
# a round's minibatch plan for 10^4 clients: numpy's order on the host against the counter order
# on the device (the plan the scale-1m round builds)
bench "schedule_bench, 10^4 clients" 40 "$PY" analysis/schedule_bench.py --clients 10000 \
  --device "$DEV"
# FedFV's aggregation of m = 10^4 updates of d = 54,410 (the MLP 60-200-200-10 of scale-10k and
# scale-1m), tau = 1, the Gram form alone (--baseline-repeats 0: the direct form's Python loop
# over client pairs would take hours at this m)
bench "FedFV aggregation, m = 10^4, d = 54,410" 80 "$PY" -m mpifl bench aggregation \
  --algorithms fedfv --m 10000 --d 54410 --repeats 3 --baseline-repeats 0 \
  --warmup 1 --device "$DEV"
# the peer benchmark (analysis/peer_bench.py), each simulator in its own process on the device:
# W3 (pfl-research's CIFAR-10 benchmark shape, on the generated stand-in) and W2 (the FedAvg
# CNN on Fashion-MNIST); mpifl alone where pfl cannot be imported (scipy not carried)
PEER=(analysis/peer_bench.py --device "$DEV" --rounds 8 --warmup 3 --threads "$OMP_NUM_THREADS")
if "$PY" -c "import pfl.algorithm" 2>/dev/null; then PEER+=(--separate 1); else
  echo "gpu_check: pfl-research cannot be imported here: the peer benchmark runs mpifl alone" \
    | tee -a "$OUT/bench.log"
  PEER+=(--only mpifl)
fi
bench "peer W3 (pfl_simple_cnn), 8 rounds" 100 "$PY" "${PEER[@]}" --model pfl_simple_cnn
bench "peer W2 (cnn_mnist), 8 rounds" 60 "$PY" "${PEER[@]}" --model cnn_mnist

mark "done"
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
grep -E "^=== |s/round|progress:|steady round|ratio pfl|runs \(ms\)|^fedfv|^  (pcg64|counter)" \
  "$OUT/bench.log" | tail -60
echo "gpu_check: $(( $(date +%s) - T0 )) s in all" | tee -a "$OUT/bench.log"
# the GPU's busy fraction over the whole check (smi-marks.txt says when each step began)
awk -F', ' 'NR > 1 && $2 ~ /%/ { n++; s += $2 + 0; if ($2 + 0 > 0) busy++ }
  END { if (n) printf "nvidia-smi: %d samples, mean utilization %.1f%%, busy in %.1f%%\n",
        n, s / n, 100 * busy / n }' "$OUT/smi.csv" 2>/dev/null | tee -a "$OUT/bench.log"
