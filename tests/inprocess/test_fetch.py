"""fetch_dataset: downloads from a file:// mirror, checksum verification, skipping verified
files, failure messages, and safe extraction of CIFAR tarballs. No network is used."""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

from mpifl.data import fetch as F
from mpifl.data import fetch_dataset, load_federated
from mpifl.core.errors import DataError

IDX_NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def idx_gz(arr: np.ndarray) -> bytes:
    head = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return gzip.compress(head + arr.astype(np.uint8).tobytes())


@pytest.fixture
def fmnist_mirror(tmp_path, monkeypatch):
    """A file:// mirror with four small valid IDX files; SOURCES pinned to their md5s."""
    src = tmp_path / "mirror"
    src.mkdir()
    rng = np.random.default_rng(0)
    blobs = {
        IDX_NAMES[0]: idx_gz(rng.integers(0, 256, (20, 28, 28))),
        IDX_NAMES[1]: idx_gz(np.arange(20) % 10),
        IDX_NAMES[2]: idx_gz(rng.integers(0, 256, (10, 28, 28))),
        IDX_NAMES[3]: idx_gz(np.arange(10) % 10),
    }
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    official = F.SOURCES["fashion_mnist"]
    monkeypatch.setitem(F.SOURCES, "fashion_mnist", F.Source(
        official.base_url, tuple((n, md5(blobs[n])) for n in IDX_NAMES)))
    return src, blobs


def test_official_checksums_are_pinned():
    # the published values (Zalando, LeCun / ossci mirror, Krizhevsky)
    got = {n: dict(s.files) for n, s in F.SOURCES.items()}
    assert got["fashion_mnist"]["train-images-idx3-ubyte.gz"] == "8d4fb7e6c68d591d4c3dfef9ec88bf0d"
    assert got["mnist"]["t10k-labels-idx1-ubyte.gz"] == "ec29112dd5afa0611ce80d1b7f02629c"
    assert got["cifar10"]["cifar-10-python.tar.gz"] == "c58f30108f718f92721af3b95e74349a"
    assert got["cifar100"]["cifar-100-python.tar.gz"] == "eb9058c3a382ffc7106e4002c42a8d85"
    assert all(len(s.files) == 4 for n, s in F.SOURCES.items() if not s.archive)


def test_fetch_success_then_loadable(tmp_path, fmnist_mirror):
    src, blobs = fmnist_mirror
    root = tmp_path / "data"
    folder = fetch_dataset("fashion_mnist", root=root, base_url=src.as_uri())
    assert folder == root / "fashion-mnist"
    for name, data in blobs.items():
        assert (folder / name).read_bytes() == data
    assert sorted(p.name for p in folder.iterdir()) == sorted(IDX_NAMES)  # no temp files left
    d = load_federated("fashion_mnist", partition="iid", num_clients=3, seed=0, data_root=root)
    assert d.x.shape == (30, 1, 28, 28)


def test_second_fetch_skips_verified_files(tmp_path, fmnist_mirror):
    src, blobs = fmnist_mirror
    root = tmp_path / "data"
    folder = fetch_dataset("fashion_mnist", root=root, base_url=src.as_uri())
    stamps = {n: (folder / n).stat().st_mtime_ns for n in IDX_NAMES}
    for f in src.iterdir():
        f.unlink()  # any download attempt would now fail
    assert fetch_dataset("fashion_mnist", root=root, base_url=src.as_uri()) == folder
    assert stamps == {n: (folder / n).stat().st_mtime_ns for n in IDX_NAMES}


def test_damaged_local_file_is_downloaded_again(tmp_path, fmnist_mirror):
    src, blobs = fmnist_mirror
    root = tmp_path / "data"
    folder = fetch_dataset("fashion_mnist", root=root, base_url=src.as_uri())
    (folder / IDX_NAMES[2]).write_bytes(b"junk")
    fetch_dataset("fashion_mnist", root=root, base_url=src.as_uri())
    assert (folder / IDX_NAMES[2]).read_bytes() == blobs[IDX_NAMES[2]]


def test_checksum_mismatch_removes_file(tmp_path, fmnist_mirror):
    src, blobs = fmnist_mirror
    (src / IDX_NAMES[1]).write_bytes(blobs[IDX_NAMES[1]] + b"tampered")
    root = tmp_path / "data"
    with pytest.raises(DataError, match="checksum mismatch") as info:
        fetch_dataset("fashion_mnist", root=root, base_url=src.as_uri())
    assert "\n" not in str(info.value)
    folder = root / "fashion-mnist"
    assert not (folder / IDX_NAMES[1]).exists()
    assert not any(".part" in p.name for p in folder.iterdir())
    assert (folder / IDX_NAMES[0]).exists()  # files before the bad one were kept (verified)


def test_failed_download_says_where_to_put_files(tmp_path, fmnist_mirror):
    root = tmp_path / "data"
    with pytest.raises(DataError, match="could not download") as info:
        fetch_dataset("fashion_mnist", root=root, base_url=(tmp_path / "nowhere").as_uri())
    msg = str(info.value)
    assert str(root / "fashion-mnist" / IDX_NAMES[0]) in msg and "by hand" in msg
    # a refused TCP connection takes the same path
    with pytest.raises(DataError, match="could not download http://127.0.0.1:9/"):
        fetch_dataset("mnist", root=root, base_url="http://127.0.0.1:9/")


def test_unknown_name():
    with pytest.raises(DataError, match="cannot fetch 'synthetic'"):
        fetch_dataset("synthetic")


def test_default_root_is_user_cache(tmp_path, fmnist_mirror, monkeypatch):
    src, _ = fmnist_mirror
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folder = fetch_dataset("fashion_mnist", base_url=src.as_uri())
    assert folder == tmp_path / "home" / ".cache" / "mpifl" / "data" / "fashion-mnist"


# ----------------------------------------------------------------------------- CIFAR tarballs

def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _cifar10_members(n: int = 4) -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    out = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, n)]}
        out[f"cifar-10-batches-py/{name}"] = pickle.dumps(batch, protocol=2)
    return out


def _pin(monkeypatch, src: Path, name: str, tarname: str, blob: bytes) -> None:
    (src / tarname).write_bytes(blob)
    monkeypatch.setitem(F.SOURCES, name, F.Source("unused", ((tarname, md5(blob)),), True))


def test_cifar10_fetch_extracts_and_loads(tmp_path, monkeypatch):
    src, root = tmp_path / "mirror", tmp_path / "data"
    src.mkdir()
    _pin(monkeypatch, src, "cifar10", "cifar-10-python.tar.gz", _tar_gz(_cifar10_members()))
    folder = fetch_dataset("cifar10", root=root, base_url=src.as_uri())
    assert folder == root / "cifar-10-batches-py"
    assert (root / "cifar-10-python.tar.gz").is_file()
    d = load_federated("cifar10", partition="iid", num_clients=4, seed=0, data_root=root)
    assert d.x.shape == (24, 3, 32, 32)
    # a second fetch neither downloads nor extracts again
    stamp = (folder / "data_batch_1").stat().st_mtime_ns
    (src / "cifar-10-python.tar.gz").unlink()
    assert fetch_dataset("cifar10", root=root, base_url=src.as_uri()) == folder
    assert (folder / "data_batch_1").stat().st_mtime_ns == stamp


def test_tarball_with_path_traversal_is_refused(tmp_path, monkeypatch):
    src, root = tmp_path / "mirror", tmp_path / "data"
    src.mkdir()
    members = _cifar10_members()
    members["../escaped"] = b"outside the data root"
    _pin(monkeypatch, src, "cifar10", "cifar-10-python.tar.gz", _tar_gz(members))
    with pytest.raises(DataError, match="cannot extract"):
        fetch_dataset("cifar10", root=root, base_url=src.as_uri())
    assert not (tmp_path / "escaped").exists()
    assert not (root / "cifar-10-batches-py").exists()  # members are checked before extracting


def test_tarball_without_expected_folder(tmp_path, monkeypatch):
    src, root = tmp_path / "mirror", tmp_path / "data"
    src.mkdir()
    _pin(monkeypatch, src, "cifar100", "cifar-100-python.tar.gz", _tar_gz({"other/x": b"1"}))
    with pytest.raises(DataError, match="did not contain the expected"):
        fetch_dataset("cifar100", root=root, base_url=src.as_uri())
