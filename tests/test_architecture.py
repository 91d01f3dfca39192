"""The layers of mpifl/ (pyproject's [tool.importlinter] contract): imports point only downward,
and no folder is imported by a folder below it. import-linter reads every import, function-local
ones included, so a lazy upward import is caught too."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
