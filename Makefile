# Set-up and the two entry points of the README: `make demo` (main job) and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
FMNIST := /usr/share/datasets/fashion-mnist
RANKS ?= 3

.PHONY: install data slurm-deps demo check lint types unit docs test bench gpu-check gpu-wheels clean

# torch first, pinned: on these machines 2.13.0 is a local CPU build; an unpinned torch would
# pull gigabytes of CUDA packages.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[mpi,dev,docs]"

# Real Fashion-MNIST from Debian's dataset package (root needed once).
data:
	@if [ -d $(FMNIST) ]; then echo "Fashion-MNIST: $(FMNIST)"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	else echo "Fashion-MNIST missing: sudo apt-get install dataset-fashion-mnist, or mpifl data fetch fashion_mnist"; exit 1; fi

# SLURM for tests/slurm/test_slurm.py (a one-node cluster, slurm/local-cluster.sh) and GNU time (the
# OS's peak memory of each rank in tests/mpi/test_cluster_comforts.py): Debian's packages.
slurm-deps:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && command -v ip >/dev/null && [ -x /usr/bin/time ]; then \
	  echo "SLURM: $$(slurmctld -V)"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd munge iproute2 time; \
	else echo "SLURM missing: sudo apt-get install slurmctld slurmd munge iproute2 time (tests/slurm/test_slurm.py and tests/slurm/test_multinode.py need them)"; exit 1; fi

demo: install data
	mpiexec -n $(RANKS) python -m mpifl run jobs/fmnist-fedfv.toml --out runs/main.h5 --overwrite
	mpifl report runs/main.h5

# The fast check (no install, no MPI, under 5 minutes on 2 cores): lint, types, unit tests,
# each tier's wall time printed against its budget (tools/tiers.py).
check:
	$(PYTHON) tools/tiers.py check

lint:
	$(PYTHON) -m ruff check mpifl tests

types:
	$(PYTHON) -m mypy

# in-process tests on every core (pytest-xdist; --dist loadfile keeps a module on one worker, so
# its module fixtures are built once); tests marked mpi, slurm, slow or world are left out
unit:
	$(PYTHON) -m pytest -q -n auto --dist loadfile -m "not mpi and not slurm and not slow and not world and not replay"

# the documentation site, warnings as errors (open build/site/index.html)
docs:
	$(PYTHON) -m mkdocs build --strict -d build/site

# The full suite (what CI runs; at most 20 minutes on 2 cores): lint, types and the site, every
# in-process test on every core while one launched MPI world makes the runs they read
# (tests/world.py), then the tests that need real ranks or the SLURM cluster, two files at a time
# (they mostly wait). tools/tiers.py prints each tier's wall time against its budget.
test: install data slurm-deps
	$(PYTHON) tools/tiers.py test

bench: install
	mpifl bench aggregation --algorithms fedfv --m 10,60,200 --d 199210

# On a CUDA node (no network needed): versions, pytest -m gpu, timed GPU runs; logs in $$OUT.
# Beforehand, where pip works: make gpu-wheels (the node's missing wheels and data, in .whl/).
gpu-check:
	bash tools/gpu_check.sh

gpu-wheels:
	bash tools/gpu_wheels.sh

clean:
	rm -rf runs .pytest_cache build *.egg-info
