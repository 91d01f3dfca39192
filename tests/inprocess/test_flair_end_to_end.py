"""FLAIR end to end: a small file in pfl-research's layout (``flair_federated.hdf5``) trained
in-process with the multi-label loss ``multilabel_bce``, its per-label accuracy and loss checked
against a computation of this test's own from the saved model, the job file's loss, the default
loss refused in one line, ``mse`` still running, and a run stopped at a checkpoint and resumed
equal to one left alone, array for array."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import mpifl
from mpifl.core.errors import ConfigError
from mpifl.data import load_federated
from mpifl.models.zoo import build_model
from mpifl.store.results import MEASURED_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
CLASSES, USERS, SIDE = 5, 6, 6


def write_flair(root: Path, seed: int = 0) -> Path:
    """USERS users over the three partitions, 8 to 13 images of SIDE x SIDE each; label j is
    present where colour channel j % 3 of the image's quadrant j // 3 is bright, so that the
    labels depend on the pixels (one to CLASSES labels an image, and some none)."""
    rng = np.random.default_rng(seed)
    path = root / "flair" / "flair_federated.hdf5"
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for u in range(USERS):
            part = ("train", "val", "test")[u % 3]
            n = 8 + u
            images = rng.integers(0, 256, (n, SIDE, SIDE, 3), dtype=np.uint8)
            half = SIDE // 2
            rows, cols = [], []
            for i in range(n):
                for j in range(CLASSES):
                    q = j // 3
                    patch = images[i, (q // 2) * half:(q // 2 + 1) * half,
                                   (q % 2) * half:(q % 2 + 1) * half, j % 3]
                    if patch.mean() > 127:
                        rows.append(i)
                        cols.append(j)
            g = f.create_group(f"{part}/user{u}")
            g["images"] = images
            g["labels_row"] = np.asarray(rows, dtype=np.uint16)
            g["labels_col"] = np.asarray(cols, dtype=np.uint8)
            g["image_ids"] = np.asarray([b"id"] * n, dtype="S")
        f["/metadata/label_mapping"] = json.dumps({f"label{j}": j for j in range(CLASSES)})
    return path


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flair-root")
    write_flair(root)
    return root


def _tables(root: Path, **model) -> dict:
    return {"run": {"name": "flair-small", "seed": 3, "rounds": 4, "eval_every": 2,
                    "checkpoint_every": 0, "threads": 1},
            "data": {"dataset": "flair", "partition": "natural", "num_clients": USERS,
                     "data_root": str(root), "train_fraction": 0.75},
            "model": {"name": "mlp", "hidden": [16], "loss": "multilabel_bce", **model},
            "client": {"batch_size": 4, "lr": 0.5},
            "server": {"algorithm": "fedavg", "clients_per_round": 3}}


def contents(path: Path) -> dict[str, np.ndarray]:
    """Everything a run computes: the model, /eval and /rounds (timings and memory aside)."""
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        out = {"model/global": f["model/global"][()]}
        for group in ("eval", "rounds"):
            keys: list[str] = []
            f[group].visit(keys.append)
            for key in keys:
                if isinstance(f[group][key], h5py.Dataset) and key not in MEASURED_COLUMNS:
                    out[f"{group}/{key}"] = f[group][key][()]
    return out


def test_multilabel_run_reports_per_label_accuracy_of_its_model(data_root, tmp_path):
    out = tmp_path / "ml.h5"
    mpifl.run(_tables(data_root), out=out, progress=False)
    got = contents(out)
    acc, loss = got["eval/client_accuracy"], got["eval/client_loss"]
    assert acc.shape == loss.shape == (2, USERS)
    assert np.isfinite(acc).all() and np.isfinite(loss).all()
    # the last evaluation (round 4) is of the saved model: recompute it here, per client, from
    # the test split, with torch's BCEWithLogitsLoss and a threshold of probability 1/2
    fed = load_federated("flair", partition="natural", num_clients=USERS, seed=3,
                         train_fraction=0.75, data_root=str(data_root))
    assert fed.y.shape[1] == CLASSES and fed.y.dtype == np.float32
    model = build_model("mlp", fed.input_shape, CLASSES, seed=3, hidden=(16,))
    w = torch.from_numpy(got["model/global"])
    torch.nn.utils.vector_to_parameters(w, model.parameters())
    bce = nn.BCEWithLogitsLoss(reduction="none")
    with torch.no_grad():
        for k in range(USERS):
            rows = fed.test_indices(k)
            x, y = torch.from_numpy(fed.x[rows]), torch.from_numpy(fed.y[rows])
            logits = model(x)
            right = (torch.sigmoid(logits) > 0.5) == (y == 1)
            np.testing.assert_allclose(acc[-1, k], right.double().mean().item(), rtol=1e-6)
            np.testing.assert_allclose(loss[-1, k], bce(logits, y).double().mean().item(),
                                       rtol=1e-5)
    # the two evaluations are of different models: training moved them
    assert not np.array_equal(loss[0], loss[-1])


def test_the_job_file_trains_flair_with_the_multilabel_loss(data_root, tmp_path):
    job = ROOT / "jobs" / "flair.toml"
    assert tomllib.loads(job.read_text())["model"]["loss"] == "multilabel_bce"
    out = tmp_path / "job.h5"
    mpifl.run(job, out=out, progress=False, overrides={
        "data.data_root": str(data_root), "data.num_clients": USERS,
        "server.clients_per_round": 2, "run.rounds": 2, "run.eval_every": 1,
        "model.name": "mlp", "model.hidden": [8], "client.batch_size": 4, "run.threads": 1})
    acc = contents(out)["eval/client_accuracy"]
    assert np.isfinite(acc).all() and ((0 <= acc) & (acc <= 1)).all()


@pytest.mark.parametrize("loss", [None, "bce", "token_cross_entropy"])
def test_single_label_losses_are_refused_naming_the_multilabel_one(data_root, tmp_path, loss):
    tables = _tables(data_root)
    del tables["model"]["loss"]  # None: cross_entropy, the config's default
    if loss is not None:
        tables["model"]["loss"] = loss
    out = tmp_path / "refused.h5"
    with pytest.raises(ConfigError) as err:
        mpifl.run(tables, out=out, progress=False)
    message = str(err.value)
    assert "\n" not in message and not out.exists()
    assert f"model.loss: '{loss or 'cross_entropy'}' needs" in message and "'flair'" in message
    assert f"{CLASSES} multi-hot" in message and "'multilabel_bce'" in message


def test_mse_still_trains_flair_as_a_regression(data_root, tmp_path):
    out = tmp_path / "mse.h5"
    mpifl.run(_tables(data_root, loss="mse"), out=out, progress=False)
    got = contents(out)
    assert np.isnan(got["eval/client_accuracy"]).all()  # no accuracy for a regression loss
    assert np.isfinite(got["eval/client_loss"]).all()


def test_a_flair_run_resumes_exactly(data_root, tmp_path):
    tables = _tables(data_root)
    tables["run"]["checkpoint_every"] = 1
    tables["server"]["optimizer"] = "adam"  # server state in the checkpoint too
    tables["server"]["lr"] = 0.05
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    mpifl.run(tables, out=whole, progress=False)
    mpifl.run(tables, out=part, overrides={"run.rounds": 2}, progress=False)
    mpifl.run(tables, out=part, overrides={"run.rounds": 4}, mode="resume", progress=False)
    a, b = contents(whole), contents(part)
    assert a.keys() == b.keys() and len(a["eval/round"]) == 2
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=True), key
