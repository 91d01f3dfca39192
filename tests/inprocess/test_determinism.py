"""``run.deterministic`` on the CPU: the settings it makes, the attribute the results record,
CPU results equal either way, and a kernel without a deterministic form (torch's ``put_``, which
refuses deterministic mode on the CPU too) reported in one line that names it and the setting.
The whole runs come from the shared MPI world (tests/world.py), except the failing one on 3 ranks.
The GPU side is tests/gpu/test_gpu.py (``pytest -m gpu``). The tests that start mpiexec
themselves are in tests/mpi/test_determinism.py."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpifl.core.errors import MpiflError, PluginFailure
from mpifl.core.blame import blame
from mpifl.runtime.determinism import (CUBLAS_WORKSPACE, Determinism, apply_determinism,
                                       named_nondeterminism, nondeterministic_line)
from mpifl.store.results import read_results
from tests.world import world_run

#: wall-clock and memory figures, never equal between two runs
VOLATILE = ("time_", "peak_rss", "bytes_moved")

#: a plugin package beside the job: two losses, each cross-entropy. ``probe`` appends the
#: training process's determinism settings to the file MPIFL_PROBE names (relative to the
#: plugin's folder, or absolute); ``put_ce`` also writes a scratch tensor with torch's put_,
#: which has no deterministic form
PLUGIN = '''
import os
import torch
import torch.nn.functional as F
from mpifl.plugin import Loss, register_loss


def _probe(out, y):
    with open(os.path.join(os.path.dirname(__file__), os.environ["MPIFL_PROBE"]), "a") as f:
        f.write(f"{torch.are_deterministic_algorithms_enabled()} "
                f"{torch.get_float32_matmul_precision()}\\n")
    return F.cross_entropy(out, y, reduction="none")


def _put_ce(out, y):
    torch.zeros(2).put_(torch.tensor([0]), torch.tensor([1.0]))
    return F.cross_entropy(out, y, reduction="none")


register_loss("det_probe")(Loss("det_probe", _probe, predict=lambda out: out.argmax(-1)))
register_loss("det_put_ce")(Loss("det_put_ce", _put_ce, predict=lambda out: out.argmax(-1)))
'''

JOB = """
[plugins]
modules = ["det_plugin"]
[run]
name = "determinism"
rounds = 2
eval_every = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 8
[model]
name = "mlp"
hidden = [8]
loss = "{loss}"
[client]
epochs = 1
batch_size = 10
[server]
algorithm = "fedavg"
clients_per_round = 3
"""


@pytest.fixture
def restored():
    """Whatever a test sets, the process's settings (and CUBLAS_WORKSPACE_CONFIG) come back."""
    before, env = Determinism.now(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    before.restore()
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


#: the runs only read, in the shared MPI world (tests/world.py): the plugin beside both jobs
FILES = {"det_plugin.py": PLUGIN, "det-probe.toml": JOB.format(loss="det_probe"),
         "det-put.toml": JOB.format(loss="det_put_ce")}


def _world_run(name: str, job: str, *sets: str, ranks: int = 1, out: str = "",
               extra: tuple[str, ...] = (), for_mpi: bool = False):
    """``job``.toml run on ``ranks`` ranks into ``out or name``.h5; its probe ``name``.probe."""
    words = [x for s in sets for x in ("--set", s)]
    return world_run(name, ["run", f"{{dir}}/{job}.toml", "--out", f"{{dir}}/{out or name}.h5",
                            "--no-progress", *words, *extra], ranks=ranks, files=FILES,
                     env={"MPIFL_PROBE": f"{name}.probe"}, for_mpi=for_mpi)


EXACT = _world_run("det-exact", "det-probe")
FAST = _world_run("det-fast", "det-probe", "run.deterministic=false")
PART = _world_run("det-part", "det-probe", "run.rounds=1")
RESUMED_FAST = _world_run("det-part-resumed", "det-probe", "run.deterministic=false",
                          out="det-part", extra=("--resume",))
PUT = _world_run("det-put-1", "det-put")
PUT_FAST = {1: _world_run("det-put-fast-1", "det-put", "run.deterministic=false")}


def _datasets(path: Path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset)
                     and not any(v in name for v in VOLATILE) else None)
    return found


# --------------------------------------------------------------------------- the settings


def test_true_asks_torch_for_exact_kernels(restored, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    apply_determinism(False)
    apply_determinism(True)
    now = Determinism.now()
    assert now == Determinism(algorithms=True, cudnn_deterministic=True, cudnn_benchmark=False,
                              matmul_tf32=False, cudnn_tf32=False, matmul_precision="highest")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"


def test_a_workspace_the_user_set_is_kept(restored, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # NVIDIA's other reproducible size
    apply_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_false_allows_fast_kernels_and_leaves_the_cpu_precision(restored):
    apply_determinism(True)
    apply_determinism(False)
    now = Determinism.now()
    assert not now.algorithms and not now.cudnn_deterministic
    if torch.cuda.is_available():
        assert now.cudnn_benchmark and now.matmul_tf32 and now.cudnn_tf32
    else:  # no CUDA: float32 products on the CPU keep their full precision
        assert now.matmul_precision == "highest" and not now.matmul_tf32


def test_restore_puts_back_what_a_run_changed(restored):
    apply_determinism(False)
    before = Determinism.now()
    apply_determinism(True)
    assert Determinism.now() != before
    before.restore()
    assert Determinism.now() == before


# --------------------------------------------------------------------------- one line


def _put_failure() -> RuntimeError:
    """torch's own refusal, raised by a real kernel under deterministic mode."""
    try:
        torch.zeros(2).put_(torch.tensor([0]), torch.tensor([1.0]))
    except RuntimeError as exc:
        return exc
    pytest.fail("put_ ran under deterministic mode: torch no longer refuses it on the CPU")


def test_torchs_refusal_becomes_one_line_naming_the_operation_and_the_setting(restored):
    apply_determinism(True)
    line = nondeterministic_line(_put_failure())
    assert line is not None and "\n" not in line
    assert line.startswith("put_ has no deterministic implementation")
    assert "run.deterministic = false" in line and "exactness for speed" in line


def test_a_plugins_failure_is_named_by_its_cause(restored):
    """blame() wraps a plugin model's or loss's error; the cause is what deterministic mode did."""
    apply_determinism(True)
    with pytest.raises(PluginFailure) as caught:
        with blame([("loss", "mine", _probe_outside)], "train"):
            raise _put_failure()
    assert nondeterministic_line(caught.value).startswith("put_ has no deterministic")
    with pytest.raises(MpiflError, match=r"^put_ has no deterministic implementation") as named:
        with named_nondeterminism():
            raise caught.value
    assert named.type is MpiflError


def test_other_failures_pass_unchanged():
    assert nondeterministic_line(RuntimeError("CUDA out of memory")) is None
    assert nondeterministic_line(ValueError("put_ does not have a deterministic "
                                            "implementation")) is None  # not torch's error
    with pytest.raises(KeyError):
        with named_nondeterminism():
            raise KeyError("x")


def test_cublas_without_a_workspace_names_the_variable():
    """cuBLAS's refusal (CUDA only) when the variable came after its first call; the text is
    torch's (aten/src/ATen/Context.cpp, alertCuBLASConfigNotDeterministic)."""
    text = ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms"
            "(True)` or `at::Context::setDeterministicAlgorithms(true)`, but this operation is "
            "not deterministic because it uses CuBLAS and you have CUDA >= 10.2. To enable "
            "deterministic behavior in this case, you must set an environment variable before "
            "running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 or "
            "CUBLAS_WORKSPACE_CONFIG=:16:8.")
    line = nondeterministic_line(RuntimeError(text))
    assert line is not None and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in line
    assert "run.deterministic = false" in line


def _probe_outside(out, y):  # blame() names only code outside mpifl: this test module is
    return out


# --------------------------------------------------------------------------- whole runs


def test_runs_record_it_use_it_and_equal_each_other_on_the_cpu(world):
    exact, fast = world.file(EXACT), world.file(FAST)
    assert read_results(exact)["attrs"]["deterministic"] is True
    assert read_results(fast)["attrs"]["deterministic"] is False
    # the loss saw the settings in force while it trained
    probes = [world.path(f"{run.name}.probe").read_text() for run in (EXACT, FAST)]
    assert set(probes[0].split("\n")) - {""} == {"True highest"}
    assert set(probes[1].split("\n")) - {""} == {"False highest"}
    a, b = _datasets(exact), _datasets(fast)
    assert a.keys() == b.keys() and "model/global" in a
    for name in a:
        floats = np.asarray(a[name]).dtype.kind == "f"
        assert np.array_equal(a[name], b[name], equal_nan=floats), name


def test_resume_may_change_it(world):
    assert world.status(PART) == 0, world.output(PART)[-3000:]
    assert world.status(RESUMED_FAST) == 0, world.output(RESUMED_FAST)[-3000:]


def _ends_in_one_line(status: int, output: str) -> None:
    assert status == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors and all("put_ has no deterministic implementation" in e for e in errors), \
        output[-3000:]
    assert "run.deterministic = false" in errors[0] and "Traceback" not in output


def test_a_kernel_without_a_deterministic_form_ends_the_run_in_one_line(world):
    _ends_in_one_line(world.status(PUT), world.output(PUT))
    assert world.status(PUT_FAST[1]) == 0, world.output(PUT_FAST[1])[-3000:]
