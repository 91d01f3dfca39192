"""The layers of mpifl/ (pyproject's [tool.importlinter] contracts): imports point only downward,
no folder is imported by a folder below it, and only the runtime (and the CLI) imports mpi4py.
import-linter reads every import, function-local ones included, so a lazy upward import or a
lazy ``from mpi4py import MPI`` is caught too."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contract_is_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"Contracts: (\d+) kept, 0 broken", out.stdout)


def test_every_layer_states_what_it_may_import():
    for init in sorted((ROOT / "mpifl").glob("*/__init__.py")):
        doc = init.read_text().split('"""')[1]
        assert doc.startswith(f"{init.parent.name} — "), init
        assert "May import:" in doc, init


def test_contract_catches_an_upward_import_a_loop_and_mpi_outside_the_runtime(tmp_path):
    """The contracts are not vacuous: a copy of the package with one upward import (core ->
    cli), one loop between two aggregator modules and one function-local mpi4py import in an
    aggregator (the shards' collectives, which live in runtime.shard_comm) breaks all three."""
    shutil.copytree(ROOT / "mpifl", tmp_path / "mpifl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    errors = tmp_path / "mpifl" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late():\n    import mpifl.cli  # noqa\n")
    gram = tmp_path / "mpifl" / "aggregators" / "gram.py"
    gram.write_text(gram.read_text() + "\n\ndef _late():\n    import mpifl.aggregators.qp  # noqa\n")
    qp = tmp_path / "mpifl" / "aggregators" / "qp.py"
    qp.write_text(qp.read_text() + "\n\ndef _late():\n    import mpifl.aggregators.gram  # noqa\n")
    shards = tmp_path / "mpifl" / "aggregators" / "shards.py"
    shards.write_text(shards.read_text() + "\n\ndef _late():\n    from mpi4py import MPI  # noqa\n")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    out = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "Contracts: 0 kept, 3 broken" in out.stdout, out.stdout[-3000:]
    assert "mpifl.core.errors -> mpifl.cli" in out.stdout
    assert "mpifl.aggregators is not allowed to import mpi4py" in out.stdout
    assert "mpifl.aggregators.shards -> mpi4py" in out.stdout
