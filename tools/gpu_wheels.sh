#!/usr/bin/env bash
# Download, here (with network), the wheels a GPU node without network lacks into .whl/, for
# tools/gpu_check.sh to install there. The node's image (Python 3.12, x86-64) has torch, numpy,
# h5py, xarray, pandas, tqdm, threadpoolctl; it lacks pydantic and an MPI to launch ranks with
# (mpiexec), so mpi4py and MPICH travel as a matching pair (mpi4py's wheel loads MPICH's
# library); and Fashion-MNIST, the main job's data, goes in .whl/data/. pfl-research 0.6.0 (the
# peer benchmark, analysis/peer_bench.py) and what `import pfl.algorithm` loads that the image
# lacks: dp-accounting, prv-accountant, multiprocess, dill, absl-py, attrs (packaging: xarray's
# dependency, in the image; dm-tree, mpmath, wheel: declared, not imported) and scipy, whose
# 35 MB wheel is carried only where it fits in the 64 MiB (it does not beside MPICH and
# Fashion-MNIST: then gpu_check.sh runs the peer benchmark's mpifl side alone).
#   tools/gpu_wheels.sh        then carry .whl with the repository
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
EXCLUDE=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
if [ -n "$EXCLUDE" ] && ! grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null; then
  echo '/.whl/' >> "$EXCLUDE"
fi

# name==version, the versions this project is tested with (pip list here)
WHEELS=(
  mpi4py==4.1.2 mpich==5.0.2
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing_extensions==4.16.0 tomli_w==1.2.0
  pfl==0.6.0 dp-accounting==0.5.1 prv-accountant==0.2.0 multiprocess==0.70.19 dill==0.4.1
  absl-py==1.4.0 attrs==23.2.0
)
SCIPY=scipy==1.17.1  # pfl.internal.distribution and dp_accounting.pld import it
LIMIT_KIB=$((64 * 1024))  # what the working tree may carry (tools/gpu_check.sh's node)
PLATFORMS=()
for n in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${n}_x86_64")
done
download() {  # download DIR SPEC
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$1" "$2"
}
for spec in "${WHEELS[@]}"; do
  download .whl "$spec"
done
# the main job's data (jobs/fmnist-fedfv.toml): Fashion-MNIST as Debian's package installs it
FMNIST=/usr/share/datasets/fashion-mnist
if [ -d "$FMNIST" ]; then
  mkdir -p .whl/data/fashion-mnist && cp -u "$FMNIST"/*-ubyte.gz .whl/data/fashion-mnist/
else
  echo "gpu_wheels: $FMNIST missing (make data): the main job's benchmark will fail there" >&2
fi
# scipy last, and only where it fits beside the rest (the rest of the tree is small: a margin)
if ! compgen -G ".whl/scipy-*.whl" >/dev/null; then
  TMP=$(mktemp -d)
  download "$TMP" "$SCIPY"
  need=$(( $(du -sk .whl | cut -f1) + $(du -sk "$TMP" | cut -f1) + 2048 ))
  if [ "$need" -le "$LIMIT_KIB" ]; then
    mv "$TMP"/scipy-*.whl .whl/
  else
    echo "gpu_wheels: $SCIPY does not fit (.whl/ would need $((need / 1024)) MiB of" \
      "$((LIMIT_KIB / 1024))): pfl cannot be imported on a node without scipy" >&2
  fi
  rm -rf "$TMP"
fi
ls -la .whl .whl/data/fashion-mnist 2>/dev/null
du -sh .whl  # carried with the working tree: 64 MiB at most
