"""The published-format readers (LEAF JSON, TFF h5, FLAIR h5, IDX) refuse, in one line naming
the file and the client, what they cannot read exactly: a user listed twice, non-finite
features, features of the wrong dtype or rank, text that is not Unicode, and sizes a file
declares that memory cannot hold (checked from the declared shapes before anything is read).
Files written here in the published layouts (the helpers of test_published_readers)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpifl.data.published  # noqa: F401  (registers the data sets)
from mpifl.cli import main
from mpifl.core.errors import DataError
from mpifl.data import load_population
from mpifl.data.bounds import LIMIT_VAR
from mpifl.data.idx import read_idx
from tests.inprocess.test_published_readers import _flair, _h5, _leaf_dir, _leaf_file, _load

ROOT = Path(__file__).resolve().parents[2]


def refusal(name: str, root: Path, k: int, **params) -> str:
    """The one-line DataError of loading ``name``'s first k clients."""
    with pytest.raises(DataError) as err:
        _load(name, root, k, **params)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def _raw_leaf(path: Path, users: list[str], user_data: dict) -> None:
    """A LEAF file written as given (a ``users`` list may repeat a name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"users": users, "num_samples": [2] * len(users),
                                "user_data": user_data}))


def _femnist_rows(n: int, seed: int = 0) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 784)).round(3).tolist(), rng.integers(0, 62, n).tolist()


# --------------------------------------------------------------------------- LEAF

def test_a_leaf_user_listed_twice_in_one_file_is_refused(tmp_path):
    base = _leaf_dir(tmp_path, "femnist") / "all_data"
    _raw_leaf(base / "all_data_0.json", ["w0", "w1", "w0"],
              {"w0": dict(zip("xy", _femnist_rows(3))), "w1": dict(zip("xy", _femnist_rows(2)))})
    msg = refusal("leaf_femnist", tmp_path, 2)
    assert "all_data_0.json: user 'w0' is listed twice" in msg


def test_a_leaf_user_in_two_all_data_files_is_refused(tmp_path):
    base = _leaf_dir(tmp_path, "synthetic") / "all_data"
    rng = np.random.default_rng(0)
    rows = {u: (rng.standard_normal((3, 60)).round(3).tolist(), [0, 1, 2]) for u in "ab"}
    _leaf_file(base / "all_data_0.json", {"a": rows["a"], "b": rows["b"]})
    _leaf_file(base / "all_data_1.json", {"b": rows["b"]})
    msg = refusal("leaf_synthetic", tmp_path, 2)
    assert "all_data_1.json: user 'b' is listed twice (and in" in msg
    assert "all_data_0.json)" in msg


def test_a_leaf_user_twice_in_train_is_refused_once_in_train_and_test_is_not(tmp_path):
    base = _leaf_dir(tmp_path, "femnist")
    x, y = _femnist_rows(4)
    _leaf_file(base / "train" / "a.json", {"w0": (x[:2], y[:2])})
    _leaf_file(base / "test" / "a.json", {"w0": (x[2:], y[2:])})
    fd = _load("leaf_femnist", tmp_path, 1)  # the clean case: train then test, pooled
    assert len(fd.y) == 4
    _leaf_file(base / "train" / "b.json", {"w0": (x[:2], y[:2])})
    msg = refusal("leaf_femnist", tmp_path, 1)
    assert "b.json: user 'w0' is listed twice (and in" in msg and "a.json)" in msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e300])
@pytest.mark.parametrize("name", ["leaf_femnist", "leaf_synthetic"])
def test_leaf_non_finite_features_are_refused(tmp_path, name, bad):
    width = 784 if name == "leaf_femnist" else 60
    x = np.full((3, width), 0.5).tolist()
    x[1][7] = bad  # json writes NaN / Infinity, which Python's json reads back
    _leaf_file(_leaf_dir(tmp_path, name.split("_")[1]) / "all_data" / "d.json",
               {"u7": (x, [0, 1, 0])})
    msg = refusal(name, tmp_path, 1)
    assert "d.json: user 'u7': each 'x' must be a list of" in msg and "finite numbers" in msg


def test_leaf_shakespeare_lone_surrogate_is_refused(tmp_path):
    text = "a" * 79 + "\ud800"  # json.dumps writes the escape \ud800, json.load reads it back
    _leaf_file(_leaf_dir(tmp_path, "shakespeare") / "all_data" / "s.json",
               {"ROMEO": ([text, "b" * 80], ["a", "b"])})
    msg = refusal("leaf_shakespeare", tmp_path, 1)
    assert "s.json: user 'ROMEO': the text is not valid Unicode" in msg
    assert "at character 79" in msg


def test_leaf_synthetic_huge_label_is_refused_not_allocated(tmp_path):
    base = _leaf_dir(tmp_path, "synthetic") / "all_data"
    x = np.zeros((3, 60)).tolist()
    _leaf_file(base / "d.json", {"t0": (x, [0, 2**40, 1])})
    msg = refusal("leaf_synthetic", tmp_path, 1)
    assert "d.json: user 't0': labels 'y' must be integers in 0..2147483646" in msg


def test_leaf_synthetic_classes_beyond_the_samples_are_refused_unless_set(tmp_path):
    base = _leaf_dir(tmp_path, "synthetic") / "all_data"
    x = np.zeros((3, 60)).tolist()
    _leaf_file(base / "d.json", {"t0": (x, [0, 1, 1]), "t1": (x, [0, 1_000_000, 2])})
    msg = refusal("leaf_synthetic", tmp_path, 2)
    assert "d.json: user 't1': label 1000000 makes C = 1000001 classes" in msg
    assert "more than the 6 samples" in msg and "num_classes" in msg
    # the user may say how many classes there are
    fd = _load("leaf_synthetic", tmp_path, 2, num_classes=1_000_001)
    assert fd.num_classes == 1_000_001 and fd.y.max() == 1_000_000


def test_a_leaf_file_larger_than_memory_is_not_parsed(tmp_path, monkeypatch):
    x, y = _femnist_rows(3)
    path = _leaf_dir(tmp_path, "femnist") / "all_data" / "big.json"
    _leaf_file(path, {"w0": (x, y)})
    size = path.stat().st_size
    monkeypatch.setenv(LIMIT_VAR, str(size * 4 / 2**20))  # half of what parsing may take
    msg = refusal("leaf_femnist", tmp_path, 1)
    assert f"big.json: {size:,} bytes of JSON once parsed would take" in msg
    assert f"available ({LIMIT_VAR}" in msg
    monkeypatch.setenv(LIMIT_VAR, str(size * 16 / 2**20))
    assert len(_load("leaf_femnist", tmp_path, 1).y) == 3


def test_leaf_files_that_fit_one_by_one_but_not_together_are_refused(tmp_path, monkeypatch):
    base = _leaf_dir(tmp_path, "femnist") / "all_data"
    x = np.full((2, 784), 0.5).tolist()  # "0.5, ": 5 bytes of JSON, 4 of float32
    for i in range(16):
        _leaf_file(base / f"all_data_{i}.json", {f"w{i}": (x, [1, 2])})
    largest = max(p.stat().st_size for p in base.iterdir())
    monkeypatch.setenv(LIMIT_VAR, str(8.5 * largest / 2**20))  # each file may be parsed
    msg = refusal("leaf_femnist", tmp_path, 16)
    assert "data set 'leaf_femnist': the 32 samples of its 16 users would take" in msg
    assert "data.num_clients" in msg
    assert len(_load("leaf_femnist", tmp_path, 2).y) == 4  # fewer clients fit


# --------------------------------------------------------------------------- TFF

def _emnist(tmp_path, pixels, labels, test=None):
    tff = tmp_path / "tff"
    _h5(tff / "fed_emnist_train.h5", {"w7": {"pixels": pixels, "label": labels}})
    _h5(tff / "fed_emnist_test.h5", test or {})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_tff_emnist_non_finite_pixels_are_refused(tmp_path, bad):
    px = np.full((3, 28, 28), 0.5, np.float32)
    px[2, 3, 4] = bad
    _emnist(tmp_path, px, np.array([1, 2, 3], np.int32))
    msg = refusal("tff_emnist", tmp_path, 1)
    assert "fed_emnist_train.h5: client 'w7': 'pixels' holds NaN or infinite values" in msg
    assert "row 2 of 3" in msg
    pop = load_population("tff_emnist", num_clients=1, seed=0, data_root=str(tmp_path))
    with pytest.raises(DataError, match="client 'w7': 'pixels' holds NaN"):
        pop.clients([0])


def test_tff_emnist_float64_pixels_beyond_float32_are_refused(tmp_path):
    px = np.full((2, 28, 28), 0.5)
    px[0, 0, 0] = 1e300  # finite in the file, inf once float32
    _emnist(tmp_path, px, np.array([1, 2]))
    assert "'pixels' holds NaN or infinite values (row 0 of 2" in refusal("tff_emnist",
                                                                          tmp_path, 1)


@pytest.mark.parametrize("pixels,labels,message", [
    (np.zeros((2, 28, 28), np.uint8), np.array([1, 2]), "'/examples/w7/pixels' must hold "
                                                        "floats, not uint8"),
    (np.zeros((2, 28, 28), np.float32), np.array([1.0, 2.0]), "'/examples/w7/label' must "
                                                              "hold integers, not float64"),
    (np.zeros((2, 28, 28), np.float32), np.array([[1, 2], [3, 4]]),
     "'/examples/w7/label' is missing or not a dataset of rows () (it is (2, 2))"),
    (np.zeros((3, 28, 28), np.float32), np.array([1, 2]),
     "'/examples/w7/pixels' has 3 rows, '/examples/w7/label' 2"),
    (np.zeros((2, 28, 27), np.float32), np.array([1, 2]),
     "'/examples/w7/pixels' is missing or not a dataset of rows (28, 28)"),
])
def test_tff_emnist_wrong_dtypes_ranks_and_row_counts(tmp_path, pixels, labels, message):
    _emnist(tmp_path, pixels, labels)
    msg = refusal("tff_emnist", tmp_path, 1)
    assert "fed_emnist_train.h5: client 'w7': " in msg and message in msg


@pytest.mark.parametrize("snippets,message", [
    (np.arange(3, dtype=np.int64), "must hold strings, not int64"),
    (np.ones(3), "must hold strings, not float64"),
    (np.array([[b"ab", b"cd"], [b"ef", b"gh"]]), "is missing or not a dataset of rows () "
                                                 "(it is (2, 2))"),
])
def test_tff_shakespeare_snippets_of_another_dtype_or_rank_are_refused(tmp_path, snippets,
                                                                        message):
    _h5(tmp_path / "tff" / "shakespeare_train.h5", {"ROMEO": {"snippets": snippets}})
    _h5(tmp_path / "tff" / "shakespeare_test.h5", {})
    msg = refusal("tff_shakespeare", tmp_path, 1)
    assert "shakespeare_train.h5: client 'ROMEO': '/examples/ROMEO/snippets' " in msg
    assert message in msg


def test_tff_shakespeare_fixed_length_strings_are_read(tmp_path):
    # the clean case beside the refusals: 'S' strings are strings as well as TFF's vlen ones
    _h5(tmp_path / "tff" / "shakespeare_train.h5", {"R": {"snippets": np.array([b"ab", b"c"])}})
    _h5(tmp_path / "tff" / "shakespeare_test.h5", {})
    fd = _load("tff_shakespeare", tmp_path, 1)
    assert fd.x.shape == (2, 80)


def test_tff_stackoverflow_tokens_of_another_dtype_are_refused(tmp_path):
    _h5(tmp_path / "tff" / "stackoverflow_train.h5", {"u1": {"tokens": np.arange(4)}})
    _h5(tmp_path / "tff" / "stackoverflow_test.h5", {})
    msg = refusal("tff_stackoverflow", tmp_path, 1)
    assert "stackoverflow_train.h5: client 'u1': '/examples/u1/tokens' must hold strings" in msg


def test_tff_cifar100_float_images_are_refused(tmp_path):
    tff = tmp_path / "tff"
    _h5(tff / "fed_cifar100_train.h5", {"0": {"image": np.zeros((2, 32, 32, 3)),
                                              "label": np.array([1, 2])}})
    _h5(tff / "fed_cifar100_test.h5", {})
    msg = refusal("tff_cifar100", tmp_path, 1)
    assert "fed_cifar100_train.h5: client '0': '/examples/0/image' must hold uint8" in msg


def _declared_only(path: Path, client: str, shapes: dict) -> None:
    """Datasets of the given (shape, dtype), chunked and never written: the file declares them
    at a few KB on disk (h5py reads the fill value), as a damaged header would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for key, (shape, dtype) in shapes.items():
            f.create_dataset(f"examples/{client}/{key}", shape=shape, dtype=dtype,
                             chunks=(1, *shape[1:]))


def test_an_h5_client_of_a_billion_rows_is_refused_before_reading(tmp_path):
    tff = tmp_path / "tff"
    _declared_only(tff / "fed_emnist_train.h5", "w9", {"pixels": ((10**9, 28, 28), "f4"),
                                                        "label": ((10**9,), "i4")})
    _h5(tff / "fed_emnist_test.h5", {})
    msg = refusal("tff_emnist", tmp_path, 1)
    assert "fed_emnist_train.h5: client 'w9': its 1,000,000,000 samples would take" in msg
    assert "TiB in memory, more than the" in msg
    with pytest.raises(DataError, match="client 'w9': its 1,000,000,000 samples"):
        load_population("tff_emnist", num_clients=1, seed=0, data_root=str(tmp_path))


def test_a_huge_h5_string_feature_is_refused_before_reading(tmp_path):
    path = tmp_path / "tff" / "shakespeare_train.h5"
    path.parent.mkdir(parents=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/R/snippets", shape=(10**11,),
                         dtype=h5py.string_dtype(), chunks=(1000,))
    _h5(tmp_path / "tff" / "shakespeare_test.h5", {})
    msg = refusal("tff_shakespeare", tmp_path, 1)
    assert "shakespeare_train.h5: client 'R': 'snippets' of 100,000,000,000 rows would " \
        "take" in msg


def test_clients_that_fit_one_by_one_but_not_together_are_refused_eagerly(tmp_path, monkeypatch):
    n = 100_000
    tff = tmp_path / "tff"
    tff.mkdir()
    with h5py.File(tff / "fed_emnist_train.h5", "w") as f:
        for c in ("a", "b", "c"):
            f.create_dataset(f"examples/{c}/pixels", shape=(n, 28, 28), dtype="f4",
                             chunks=(1, 28, 28))
            f.create_dataset(f"examples/{c}/label", shape=(n,), dtype="i4", chunks=(n,))
    _h5(tff / "fed_emnist_test.h5", {})
    one = n * (28 * 28 * 4 + 8)  # one client's x and y in the pool
    # each client's read and conversion (about 2 copies) fits; the pool of 3 does not
    monkeypatch.setenv(LIMIT_VAR, str(2.5 * one / 2**20))
    msg = refusal("tff_emnist", tmp_path, 3)
    assert "data set 'tff_emnist': the 300,000 samples of its 3 clients would take" in msg
    assert "data.num_clients" in msg and "data.lazy = true" in msg
    # the lazy population holds a few clients at a time: its set-up reads shapes only
    pop = load_population("tff_emnist", num_clients=3, seed=0, data_root=str(tmp_path))
    assert list(pop.sizes) == [n, n, n]


# --------------------------------------------------------------------------- FLAIR

def test_flair_images_of_60000_squared_pixels_are_refused_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "flair" / "flair_federated.hdf5"
    _flair(path, {("train", "u1"): (np.zeros((2, 4, 4, 3), np.uint8), [[0], [1]])})
    with h5py.File(path, "a") as f:
        del f["/train/u1/images"]
        f.create_dataset("/train/u1/images", shape=(2, 60000, 60000, 3), dtype=np.uint8,
                         chunks=(1, 64, 64, 3))
    monkeypatch.setenv(LIMIT_VAR, str(64 * 1024))  # 64 GiB: the test means the same anywhere
    msg = refusal("flair", tmp_path, 1, partitions=["train"])
    assert "flair_federated.hdf5: client 'u1': 2 images of (60000, 60000, 3) would take" in msg
    assert f"more than the 64.0 GiB available ({LIMIT_VAR}" in msg


@pytest.mark.parametrize("images,message", [
    (np.full((2, 4, 4, 3), 0.5), "'/train/u1/images' must hold uint8, not float64"),
    (np.zeros((2, 4, 4), np.uint8), "'/train/u1/images' must be (n, H, W, 3) uint8"),
])
def test_flair_images_of_another_dtype_or_rank_are_refused(tmp_path, images, message):
    _flair(tmp_path / "flair" / "flair_federated.hdf5",
           {("train", "u1"): (images, [[0], [1]])})
    msg = refusal("flair", tmp_path, 1, partitions=["train"])
    assert "flair_federated.hdf5: client 'u1': " in msg and message in msg


def test_flair_float_label_coordinates_and_a_bad_mapping_are_refused(tmp_path):
    path = tmp_path / "flair" / "flair_federated.hdf5"
    _flair(path, {("train", "u1"): (np.zeros((2, 4, 4, 3), np.uint8), [[0], [1]])})
    with h5py.File(path, "a") as f:
        del f["/train/u1/labels_col"]
        f["/train/u1/labels_col"] = np.array([0.0, 1.5])
    msg = refusal("flair", tmp_path, 1, partitions=["train"])
    assert "client 'u1': '/train/u1/labels_col' must hold integers, not float64" in msg
    with h5py.File(path, "a") as f:
        del f["/metadata/label_mapping"]
        f["/metadata/label_mapping"] = json.dumps({"a": 0, "b": 2})  # index 1 missing
    assert "label_mapping' must be a JSON object label -> index 0..C-1" in refusal(
        "flair", tmp_path, 1, partitions=["train"])


# --------------------------------------------------------------------------- IDX

def test_an_idx_header_whose_size_wraps_int64_is_refused(tmp_path):
    # 65,536^4 = 2^64 elements: numpy's int64 product is 0, which the bare header matched
    (tmp_path / "wrap").write_bytes(bytes([0, 0, 8, 4]) + struct.pack(">IIII", *[65536] * 4))
    with pytest.raises(DataError, match=r"wrap is truncated: 20 bytes, header \(65536, "):
        read_idx(tmp_path / "wrap")


def test_a_gzip_idx_declaring_more_than_memory_is_not_decompressed(tmp_path, monkeypatch):
    path = tmp_path / "big.gz"
    path.write_bytes(gzip.compress(bytes([0, 0, 8, 2]) + struct.pack(">II", 1000, 1000)
                                   + bytes(10)))
    monkeypatch.setenv(LIMIT_VAR, "0.5")  # 512 KiB < the 1,000,000 bytes declared
    with pytest.raises(DataError, match=r"big\.gz: header \(1000, 1000\) would take 976\.6 KiB"):
        read_idx(path)
    monkeypatch.delenv(LIMIT_VAR)
    with pytest.raises(DataError, match=r"big\.gz is truncated: 22 bytes"):
        read_idx(path)


# --------------------------------------------------------------------------- the command line

def _cli(tmp_path, capsys, dataset: str) -> str:
    argv = ["run", str(ROOT / "jobs" / "leaf-femnist.toml"), "--out", str(tmp_path / "r.h5"),
            "--no-progress"]
    for o in (f"data.dataset={dataset}", f"data.data_root={tmp_path}", "data.num_clients=1",
              "server.clients_per_round=1", "run.rounds=1"):
        argv += ["--set", o]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mpifl: error: "), err
    assert not (tmp_path / "r.h5").exists()
    return err[0]


def test_the_command_line_refuses_a_duplicated_leaf_user_in_one_line(tmp_path, capsys):
    _raw_leaf(_leaf_dir(tmp_path, "femnist") / "all_data" / "all_data_0.json", ["w0", "w0"],
              {"w0": dict(zip("xy", _femnist_rows(3)))})
    line = _cli(tmp_path, capsys, "leaf_femnist")
    assert "all_data_0.json: user 'w0' is listed twice" in line


def test_the_command_line_refuses_nan_tff_pixels_in_one_line(tmp_path, capsys):
    px = np.full((3, 28, 28), 0.5, np.float32)
    px[1, 0, 0] = np.nan
    _emnist(tmp_path, px, np.array([1, 2, 3], np.int32))
    line = _cli(tmp_path, capsys, "tff_emnist")
    assert "fed_emnist_train.h5: client 'w7': 'pixels' holds NaN or infinite values" in line


def test_the_command_line_refuses_a_billion_row_client_in_one_line(tmp_path, capsys):
    tff = tmp_path / "tff"
    _declared_only(tff / "fed_emnist_train.h5", "w9", {"pixels": ((10**9, 28, 28), "f4"),
                                                        "label": ((10**9,), "i4")})
    _h5(tff / "fed_emnist_test.h5", {})
    line = _cli(tmp_path, capsys, "tff_emnist")
    assert "fed_emnist_train.h5: client 'w9': its 1,000,000,000 samples would take" in line
