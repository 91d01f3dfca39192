#!/usr/bin/env bash
# The README's headline tables, measured: each job over seeds 0-2, FedFV against FedAvg, mean ± std
# over seeds of each run's mean of its last 3 evaluations; the machine is printed with them.
#   analysis/headline.sh [OUT_DIR]        (default runs/headline; about 3 min on 2 CPU cores)
set -euo pipefail
out=${1:-runs/headline}
ranks=${RANKS:-3}
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; $(python -c 'import torch; print("torch", torch.__version__)'); load $(cut -d' ' -f1-3 /proc/loadavg)"
for algo in fedfv fedavg; do   # the main job, 100 rounds, 3 ranks a run
  mpifl run jobs/fmnist-fedfv.toml --seeds 0-2 --ranks "$ranks" --set server.algorithm=$algo \
    --out "$out/main-$algo" > /dev/null
done
for algo in fedfv fedavg; do   # the FedFV paper's 3-client Fashion-MNIST setting, 200 rounds, 1 process
  mpifl run jobs/fedfv-fmnist3.toml --seeds 0-2 --set server.algorithm=$algo --out "$out/fmnist3-$algo" > /dev/null
done
echo "## main job (jobs/fmnist-fedfv.toml)"
mpifl report "$out"/main-*/runs/*.h5 | sed -n '/over seeds/,$p'
echo "## FedFV's 3-client setting (jobs/fedfv-fmnist3.toml)"
mpifl report "$out"/fmnist3-*/runs/*.h5 | sed -n '/over seeds/,$p'
