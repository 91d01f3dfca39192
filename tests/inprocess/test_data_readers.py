"""Dataset readers: IDX (raw and gzip), CIFAR pickles read without unsafe unpickling, the data
root search, and the real Fashion-MNIST that Debian installs in /usr/share/datasets."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from mpifl.data import load_federated
from mpifl.data import roots
from mpifl.data.cifar import load_cifar10_pool, load_cifar100_pool, read_cifar_batch
from mpifl.data.idx import load_idx_pool, read_idx
from mpifl.core.errors import DataError

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
             np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}
SYSTEM_FMNIST = Path("/usr/share/datasets/fashion-mnist")


# ----------------------------------------------------------------------------- file writers

def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX encoding of arr, written from the format description (big-endian)."""
    big = arr.astype(arr.dtype.newbyteorder(">")) if arr.dtype.itemsize > 1 else arr
    head = bytes([0, 0, IDX_CODES[big.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + big.tobytes()


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> Path:
    data = idx_bytes(arr)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_mnist_like(folder: Path, n_train: int, n_test: int, seed: int = 0, gz=(True, False)):
    """A fake (F)MNIST folder; images gzip, labels raw by default (both forms must work)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", x, gz[0])
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", y, gz[1])
        out[prefix] = (x, y)
    return out


class Py2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 ``str`` opcodes (BINSTRING), like the official CIFAR files."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str


def write_cifar_batch(path: Path, data: np.ndarray, labels, label_key: bytes, py2: bool = True):
    batch = {b"batch_label": b"testing batch", label_key: labels, b"data": data,
             b"filenames": [b"f%d.png" % i for i in range(len(data))]}
    if py2:
        buf = io.BytesIO()
        Py2Pickler(buf, protocol=2).dump(batch)
        path.write_bytes(buf.getvalue())
    else:
        path.write_bytes(pickle.dumps(batch, protocol=4))


def make_cifar10(folder: Path, per_batch: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        x = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, per_batch)]
        write_cifar_batch(folder / name, x, y, b"labels", py2=i % 2 == 0)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


# ----------------------------------------------------------------------------- IDX

@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype,shape", [(np.uint8, (5, 4, 3)), (np.int8, (7,)),
                                         (">i2", (3, 2)), (">i4", (4, 5)), (">f4", (6,)),
                                         (">f8", (2, 2, 2))])
def test_idx_roundtrip(tmp_path, gz, dtype, shape):
    rng = np.random.default_rng(1)
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    path = write_idx(tmp_path / "a-idx", arr, gz)
    out = read_idx(path)
    assert out.shape == shape
    assert out.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(out, arr)


def test_idx_truncated_raw(tmp_path):
    path = write_idx(tmp_path / "t-idx", np.zeros((10, 28, 28), np.uint8), gz=False)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(DataError, match="truncated"):
        read_idx(path)


def test_idx_truncated_gzip_stream(tmp_path):
    data = gzip.compress(idx_bytes(np.arange(4000, dtype=np.uint8).reshape(40, 100)))
    path = tmp_path / "t.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="cannot read IDX"):
        read_idx(path)


def test_idx_trailing_bytes_and_bad_magic(tmp_path):
    good = idx_bytes(np.zeros(8, np.uint8))
    (tmp_path / "long").write_bytes(good + b"\0")
    with pytest.raises(DataError, match="longer than its header"):
        read_idx(tmp_path / "long")
    (tmp_path / "magic").write_bytes(b"\x01" + good[1:])
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "magic")
    (tmp_path / "code").write_bytes(good[:2] + b"\x07" + good[3:])
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "code")


def test_idx_huge_header_is_rejected_not_allocated(tmp_path):
    # dims claim 4e9 elements; the reader must compare sizes before allocating anything
    (tmp_path / "huge").write_bytes(bytes([0, 0, 8, 2]) + struct.pack(">II", 65536, 65536))
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "huge")


def test_idx_pool_mixed_gz_and_raw(tmp_path):
    files = write_mnist_like(tmp_path / "m", 12, 5)
    x, y = load_idx_pool(tmp_path / "m")
    assert x.shape == (17, 28, 28) and x.dtype == np.uint8 and y.dtype == np.int64
    np.testing.assert_array_equal(x, np.concatenate([files["train"][0], files["t10k"][0]]))
    np.testing.assert_array_equal(y, np.concatenate([files["train"][1], files["t10k"][1]]))


def test_idx_pool_label_count_mismatch(tmp_path):
    write_mnist_like(tmp_path / "m", 12, 5)
    write_idx(tmp_path / "m" / "t10k-labels-idx1-ubyte", np.zeros(4, np.uint8), gz=False)
    with pytest.raises(DataError, match="expected 5 uint8 labels"):
        load_idx_pool(tmp_path / "m")


def test_load_federated_mnist_pixels_scaled(tmp_path):
    files = write_mnist_like(tmp_path / "mnist", 60, 20)
    d = load_federated("mnist", partition="iid", num_clients=4, seed=0, data_root=str(tmp_path))
    raw = np.concatenate([files["train"][0], files["t10k"][0]])
    assert d.x.shape == (80, 1, 28, 28) and d.x.dtype == np.float32
    assert d.input_shape == (1, 28, 28) and d.num_classes == 10
    np.testing.assert_allclose(d.x[:, 0], raw / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(d.y, np.concatenate([files["train"][1], files["t10k"][1]]))


# ----------------------------------------------------------------------------- CIFAR

@pytest.mark.parametrize("py2", [True, False])
def test_cifar_batch_roundtrip(tmp_path, py2):
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    write_cifar_batch(tmp_path / "b", data, [3, 1, 4, 1], b"labels", py2=py2)
    x, y = read_cifar_batch(tmp_path / "b", "labels")
    assert x.shape == (4, 3, 32, 32) and x.dtype == np.uint8
    np.testing.assert_array_equal(x.reshape(4, -1), data)
    # channel planes: the first 1024 bytes of a row are the red 32x32 image
    np.testing.assert_array_equal(x[2, 0], data[2, :1024].reshape(32, 32))
    np.testing.assert_array_equal(y, [3, 1, 4, 1])


def test_cifar10_pool_and_normalisation(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    data, labels = make_cifar10(folder)
    x, y = load_cifar10_pool(folder)
    np.testing.assert_array_equal(x.reshape(len(x), -1), data)
    np.testing.assert_array_equal(y, labels)

    d = load_federated("cifar10", partition="iid", num_clients=3, seed=0, data_root=tmp_path)
    assert d.x.shape == (36, 3, 32, 32) and d.input_shape == (3, 32, 32)
    scaled = data.reshape(-1, 3, 32, 32) / 255.0
    mean = scaled.mean(axis=(0, 2, 3), keepdims=True)
    std = scaled.std(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(d.x, (scaled - mean) / std, rtol=1e-4, atol=1e-5)


def test_cifar100_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(3)
    parts = []
    for name, n in (("train", 5), ("test", 3)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, 100, n)]
        batch = {b"data": data, b"fine_labels": fine, b"coarse_labels": [0] * n}
        buf = io.BytesIO()
        Py2Pickler(buf, protocol=2).dump(batch)
        (folder / name).write_bytes(buf.getvalue())
        parts.append((data, fine))
    x, y = load_cifar100_pool(folder)
    np.testing.assert_array_equal(x.reshape(8, -1), np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(y, parts[0][1] + parts[1][1])


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar_pickle_with_os_system_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = {b"data": _Evil(marker), b"labels": [0]}
    (tmp_path / "evil").write_bytes(pickle.dumps(payload, protocol=2))
    # sanity: the payload really names os.system (pickled as posix.system)
    assert b"system" in (tmp_path / "evil").read_bytes()
    with pytest.raises(DataError, match="refusing to load posix.system"):
        read_cifar_batch(tmp_path / "evil", "labels")
    assert not marker.exists()


def test_cifar_damaged_files(tmp_path):
    good = tmp_path / "good"
    write_cifar_batch(good, np.zeros((2, 3072), np.uint8), [0, 1], b"labels")
    (tmp_path / "cut").write_bytes(good.read_bytes()[:100])
    with pytest.raises(DataError, match="cannot read CIFAR batch"):
        read_cifar_batch(tmp_path / "cut", "labels")
    write_cifar_batch(tmp_path / "shape", np.zeros((2, 100), np.uint8), [0, 1], b"labels")
    with pytest.raises(DataError, match=r"\(n, 3072\) uint8"):
        read_cifar_batch(tmp_path / "shape", "labels")
    write_cifar_batch(tmp_path / "nlab", np.zeros((2, 3072), np.uint8), [0], b"labels")
    with pytest.raises(DataError, match="does not have 2 labels"):
        read_cifar_batch(tmp_path / "nlab", "labels")
    with pytest.raises(DataError, match="'fine_labels' is missing"):
        read_cifar_batch(good, "fine_labels")


# ----------------------------------------------------------------------------- data roots

@pytest.fixture
def isolated_roots(tmp_path, monkeypatch):
    """HOME and the system root point into tmp_path; $MPIFL_DATA is unset."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MPIFL_DATA", raising=False)
    monkeypatch.setattr(roots, "SYSTEM_ROOT", tmp_path / "sys")
    return tmp_path


def test_missing_dataset_lists_every_default_path(isolated_roots):
    t = isolated_roots
    with pytest.raises(DataError) as info:
        load_federated("mnist", partition="iid", num_clients=2, seed=0)
    msg = str(info.value)
    expected = [t / "home" / ".cache" / "mpifl" / "data" / "mnist", t / "sys" / "mnist"]
    positions = [msg.index(str(p)) for p in expected]
    assert positions == sorted(positions), "paths must be listed in search order"
    assert "mpifl data fetch mnist" in msg and "\n" not in msg
    assert "apt-get" not in msg


def test_missing_fashion_mnist_mentions_debian_package(isolated_roots):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        roots.find_dataset_dir("fashion_mnist")


def test_default_roots_in_order_and_incomplete_folders_skipped(isolated_roots):
    t = isolated_roots
    cache = t / "home" / ".cache" / "mpifl" / "data" / "mnist"
    write_mnist_like(cache, 3, 2)
    write_mnist_like(t / "sys" / "mnist", 3, 2)
    assert roots.find_dataset_dir("mnist") == cache
    (cache / "t10k-labels-idx1-ubyte").unlink()  # incomplete: the next default root
    assert roots.find_dataset_dir("mnist") == t / "sys" / "mnist"


def test_a_named_root_is_the_only_one_searched(isolated_roots, monkeypatch):
    t = isolated_roots
    write_mnist_like(t / "sys" / "mnist", 3, 2)  # a default root that would have it
    write_mnist_like(t / "env" / "mnist", 3, 2)
    monkeypatch.setenv("MPIFL_DATA", str(t / "env"))
    assert roots.find_dataset_dir("mnist") == t / "env" / "mnist"
    write_mnist_like(t / "arg" / "mnist", 3, 2)
    assert roots.find_dataset_dir("mnist", t / "arg") == t / "arg" / "mnist"  # before the env
    (t / "env" / "mnist" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError) as info:  # incomplete: named, never a fall-back
        roots.find_dataset_dir("mnist")
    assert f"$MPIFL_DATA {t / 'env'}: {t / 'env' / 'mnist'} lacks t10k-labels-idx1-ubyte" \
        in str(info.value)
    with pytest.raises(DataError, match="data.data_root is .*nowhere, which does not exist"):
        roots.find_dataset_dir("mnist", t / "nowhere")
    monkeypatch.setenv("MPIFL_DATA", str(t / "gone"))
    with pytest.raises(DataError, match=r"\$MPIFL_DATA is .*gone, which does not exist"):
        roots.find_dataset_dir("mnist")


# ----------------------------------------------------------------------------- real data

@pytest.mark.skipif(not SYSTEM_FMNIST.is_dir(),
                    reason="no /usr/share/datasets/fashion-mnist (apt-get install "
                           "dataset-fashion-mnist)")
def test_real_fashion_mnist_from_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache copy may shadow the system one
    monkeypatch.delenv("MPIFL_DATA", raising=False)
    assert roots.find_dataset_dir("fashion_mnist") == SYSTEM_FMNIST
    d = load_federated("fashion_mnist", partition="shards", num_clients=100, seed=0)
    assert d.x.shape == (70_000, 1, 28, 28) and d.x.dtype == np.float32
    assert d.y.shape == (70_000,) and d.y.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(d.y), [7000] * 10)
    # the well-known first labels: train 9 (ankle boot), 0, 0, 3; test 9, 2, 1, 1
    np.testing.assert_array_equal(d.y[:4], [9, 0, 0, 3])
    np.testing.assert_array_equal(d.y[60_000:60_004], [9, 2, 1, 1])
    assert 0.0 <= d.x.min() and d.x.max() <= 1.0 and 0.2 < d.x.mean() < 0.4
    assert d.num_clients == 100
    assert (d.num_train + d.num_test == 700).all()
    for k in range(0, 100, 9):  # 7,000 per class and shards of 350: at most two classes
        assert len(np.unique(d.y[np.concatenate([d.train_indices(k), d.test_indices(k)])])) <= 2
