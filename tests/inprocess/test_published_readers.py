"""The published federated benchmarks' readers (LEAF JSON, TFF h5, FLAIR h5): tiny files in the
published formats written here, read back through load_federated and the lazy path."""

from __future__ import annotations

import hashlib
import json

import h5py
import numpy as np
import pytest

import mpifl.data.published  # noqa: F401  (registers the data sets)
from mpifl.core.errors import DataError
from mpifl.data import load_federated, load_population
from mpifl.data.leaf import ALL_LETTERS
from mpifl.data.registry import PAD
from mpifl.data.tff import CHAR_BOS, CHAR_EOS, CHAR_OOV, CHAR_VOCAB, TARBALLS


def _load(name, root, k, **params):
    return load_federated(name, partition="natural", num_clients=k, seed=0,
                          data_root=str(root), dataset_params=params or None)


def _client_rows(fd, k):
    return np.sort(np.concatenate([fd.train_indices(k), fd.test_indices(k)]))


# --------------------------------------------------------------------------- LEAF

def _leaf_file(path, users):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"users": list(users), "num_samples": [len(v[1]) for v in users.values()],
                   "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}, f)


def _leaf_dir(root, name):
    return root / "leaf" / "data" / name / "data"


def test_leaf_femnist_all_data(tmp_path):
    rng = np.random.default_rng(0)
    folder = _leaf_dir(tmp_path, "femnist") / "all_data"
    px = {u: rng.random((n, 784)).round(3) for u, n in (("w0", 3), ("w1", 1), ("w2", 4),
                                                        ("w3", 2))}
    labels = {u: rng.integers(0, 62, len(v)).tolist() for u, v in px.items()}
    _leaf_file(folder / "all_data_10.json", {"w3": (px["w3"].tolist(), labels["w3"])})
    _leaf_file(folder / "all_data_2.json", {u: (px[u].tolist(), labels[u])
                                            for u in ("w0", "w1", "w2")})
    fd = _load("leaf_femnist", tmp_path, 3)
    assert fd.x.shape == (9, 1, 28, 28) and fd.x.dtype == np.float32
    assert fd.num_classes == 62 and fd.y.dtype == np.int64
    # w1 (1 sample) skipped; all_data_2 before all_data_10 (numeric order)
    for k, u in enumerate(("w0", "w2", "w3")):
        rows = _client_rows(fd, k)
        assert len(rows) == len(px[u])
        np.testing.assert_array_equal(fd.x[rows].reshape(-1, 784), px[u].astype(np.float32))
        np.testing.assert_array_equal(fd.y[rows], labels[u])
    with pytest.raises(DataError, match="2 users with at least 2 samples|3 users"):
        _load("leaf_femnist", tmp_path, 4)


def test_leaf_shakespeare_split_folders_pool_train_then_test(tmp_path):
    base = _leaf_dir(tmp_path, "shakespeare")
    text = (ALL_LETTERS * 3)
    xs = [text[i:i + 80] for i in range(5)]
    ys = [text[i + 80] for i in range(5)]
    _leaf_file(base / "train" / "t.json", {"ROMEO": (xs[:2], ys[:2]), "JULIET": (xs[2:3], ys[2:3])})
    _leaf_file(base / "test" / "t.json", {"ROMEO": (xs[3:4], ys[3:4]), "JULIET": (xs[4:], ys[4:])})
    fd = _load("leaf_shakespeare", tmp_path, 2)
    assert fd.x.shape == (5, 80) and fd.x.dtype == np.int64
    assert fd.vocab_size == 81 and fd.num_classes == 81
    ids = {c: i + 1 for i, c in enumerate(ALL_LETTERS)}
    order = [0, 1, 3, 2, 4]  # ROMEO train, ROMEO test, JULIET train, JULIET test
    np.testing.assert_array_equal(fd.x, [[ids[c] for c in xs[i]] for i in order])
    np.testing.assert_array_equal(fd.y, [ids[ys[i]] for i in order])
    assert fd.x.min() >= 1  # 0 is PAD, never a character
    assert [len(_client_rows(fd, k)) for k in range(2)] == [3, 2]


def test_leaf_shakespeare_bad_character_and_bad_json(tmp_path):
    base = _leaf_dir(tmp_path, "shakespeare") / "all_data"
    _leaf_file(base / "a.json", {"A": (["\u00e9" * 80, "a" * 80], ["a", "b"])})
    with pytest.raises(DataError, match="not in LEAF's 80-character alphabet"):
        _load("leaf_shakespeare", tmp_path, 1)
    (base / "a.json").write_text("{not json")
    with pytest.raises(DataError, match=r"cannot read LEAF file .*a\.json"):
        _load("leaf_shakespeare", tmp_path, 1)


def test_leaf_sent140_vocabulary_padding_and_oov(tmp_path):
    base = _leaf_dir(tmp_path, "sent140") / "all_data"

    def tweet(t):
        return ["1", "Mon Apr 06", "NO_QUERY", "user", t]
    _leaf_file(base / "all_data_0.json", {
        "u0": ([tweet("b a a"), tweet("c b zz")], [1, 0]),
        "u1": ([tweet("a b c d e f"), tweet("")], [0, 1])})
    fd = _load("leaf_sent140", tmp_path, 2, vocab_size=3, max_length=4)
    # counts: a 3, b 3, c 2, d/e/f/zz 1: vocabulary a=2, b=3 (tie alphabetical), c=4
    assert fd.vocab_size == 5 and fd.num_classes == 2 and fd.x.shape == (4, 4)
    np.testing.assert_array_equal(fd.x, [[3, 2, 2, PAD], [4, 3, 1, PAD], [2, 3, 4, 1],
                                         [PAD] * 4])
    np.testing.assert_array_equal(fd.y, [1, 0, 0, 1])


def test_leaf_synthetic_classes_from_data(tmp_path):
    base = _leaf_dir(tmp_path, "synthetic") / "all_data"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 60)).round(4)
    _leaf_file(base / "data.json", {"f_0": (x[:3].tolist(), [0, 4, 1]),
                                    "f_1": (x[3:].tolist(), [2, 2, 3])})
    fd = _load("leaf_synthetic", tmp_path, 2)
    assert fd.x.shape == (6, 60) and fd.x.dtype == np.float32 and fd.num_classes == 5
    np.testing.assert_array_equal(fd.x, x.astype(np.float32))
    assert _load("leaf_synthetic", tmp_path, 2, num_classes=10).num_classes == 10
    with pytest.raises(DataError, match=r"labels 'y' must be integers in 0\.\.2"):
        _load("leaf_synthetic", tmp_path, 2, num_classes=3)


def test_leaf_missing_folder_names_files_and_source(tmp_path):
    tmp_path.joinpath("leaf").mkdir()
    with pytest.raises(DataError) as err:
        _load("leaf_femnist", tmp_path, 2)
    msg = str(err.value)
    assert "\n" not in msg and "all_data/*.json or train/*.json + test/*.json" in msg
    assert "github.com/TalwalkarLab/leaf" in msg and "leaf/data/femnist/data" in msg


# --------------------------------------------------------------------------- TFF

def _h5(path, clients):
    """TFF's layout: examples/<client>/<feature>."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_group("examples")
        for cid, feats in clients.items():
            for key, value in feats.items():
                if isinstance(value, list):  # strings, as TFF stores them (variable length)
                    f.create_dataset(f"examples/{cid}/{key}", data=value,
                                     dtype=h5py.string_dtype(encoding="utf-8"))
                else:
                    f[f"examples/{cid}/{key}"] = value


def test_tff_emnist_pools_train_then_test_and_lazy_equals_eager(tmp_path):
    rng = np.random.default_rng(2)
    tff = tmp_path / "tff"
    pix = {c: rng.random((n, 28, 28), dtype=np.float32) for c, n in (("a", 3), ("b", 2),
                                                                     ("c", 1))}
    lab = {c: rng.integers(0, 62, len(v)).astype(np.int32) for c, v in pix.items()}
    _h5(tff / "fed_emnist_train.h5", {c: {"pixels": pix[c][:-1], "label": lab[c][:-1]}
                                      for c in ("a", "b")})
    _h5(tff / "fed_emnist_test.h5", {"a": {"pixels": pix["a"][-1:], "label": lab["a"][-1:]},
                                     "b": {"pixels": pix["b"][-1:], "label": lab["b"][-1:]},
                                     "c": {"pixels": pix["c"], "label": lab["c"]}})
    fd = _load("tff_emnist", tmp_path, 2)
    assert fd.x.shape == (5, 1, 28, 28) and fd.x.dtype == np.float32 and fd.num_classes == 62
    np.testing.assert_array_equal(fd.x[:, 0], np.concatenate([pix["a"], pix["b"]]))
    np.testing.assert_array_equal(fd.y, np.concatenate([lab["a"], lab["b"]]))
    pop = load_population("tff_emnist", num_clients=2, seed=0, data_root=str(tmp_path))
    np.testing.assert_array_equal(pop.sizes, [3, 2])
    win = pop.clients([1, 0])
    for j, k in enumerate((1, 0)):
        rows = _client_rows(fd, k)
        np.testing.assert_array_equal(win.x[win.ptr[j]:win.ptr[j + 1]], fd.x[rows])
        np.testing.assert_array_equal(win.y[win.ptr[j]:win.ptr[j + 1]], fd.y[rows])
    with pytest.raises(DataError, match="2 clients with at least 2 samples"):
        _load("tff_emnist", tmp_path, 3)  # c has 1 sample: skipped


def test_tff_shakespeare_tokens_as_tff_baseline(tmp_path):
    snippet = "What?\n" + "x" * 80 + "\u00e9"  # 87 chars, 88 bytes (é is 2 bytes, OOV)
    _h5(tmp_path / "tff" / "shakespeare_train.h5", {"ROLE": {"snippets": [snippet, "ab"]}})
    _h5(tmp_path / "tff" / "shakespeare_test.h5", {"ROLE": {"snippets": ["c"]}})
    fd = _load("tff_shakespeare", tmp_path, 1)
    assert fd.vocab_size == 90 == fd.num_classes == len(CHAR_VOCAB) + 4
    # 1 + 88 + 1 = 90 tokens -> 2 rows of 81; "ab" -> 1 row; "c" -> 1 row
    assert fd.x.shape == (4, 80) and fd.y.shape == (4, 80) and fd.x.dtype == np.int64
    ids = {c: i + 1 for i, c in enumerate(CHAR_VOCAB)}
    seq = ([CHAR_BOS] + [ids[c] for c in snippet[:-1]] + [CHAR_OOV, CHAR_OOV, CHAR_EOS])
    seq += [PAD] * (162 - len(seq))
    np.testing.assert_array_equal(fd.x[0], seq[:80])
    np.testing.assert_array_equal(fd.y[0], seq[1:81])
    np.testing.assert_array_equal(fd.x[1], seq[81:161])
    np.testing.assert_array_equal(fd.y[1], seq[82:162])
    np.testing.assert_array_equal(fd.x[2][:4], [CHAR_BOS, ids["a"], ids["b"], CHAR_EOS])
    assert (fd.x[2][4:] == PAD).all() and (fd.y[3][2:] == PAD).all()
    np.testing.assert_array_equal(fd.y[3][:2], [ids["c"], CHAR_EOS])


def _stackoverflow(tmp_path, users, test_users):
    tff = tmp_path / "tff"
    _h5(tff / "stackoverflow_train.h5", {u: {"tokens": t, "title": ["t"] * len(t)}
                                         for u, t in users.items()})
    _h5(tff / "stackoverflow_test.h5", {u: {"tokens": t} for u, t in test_users.items()})
    return tff


def test_tff_stackoverflow_vocab_from_data_lazy_equals_eager(tmp_path):
    words = [f"w{i}" for i in range(25)]
    _stackoverflow(tmp_path, {"00": ["a b a", " ".join(words), "c"], "01": ["b a", "zz"]},
                   {"00": ["a q"], "02": ["b b", "a"]})
    params = dict(vocab_size=3, sequence_length=5)
    fd = _load("tff_stackoverflow", tmp_path, 3, **params)
    # counts over the 3 users: a 6, b 5, then c, q, w0.., zz once: a=1, b=2, c=3
    assert fd.vocab_size == 7 and fd.num_classes == 7 and fd.x.shape == (8, 5)
    oov, bos, eos = 4, 5, 6
    np.testing.assert_array_equal(fd.x[0], [bos, 1, 2, 1, eos])
    np.testing.assert_array_equal(fd.y[0], [1, 2, 1, eos, PAD])
    np.testing.assert_array_equal(fd.x[1], [bos, oov, oov, oov, oov])  # cut, no EOS
    np.testing.assert_array_equal(fd.y[1], [oov] * 5)
    np.testing.assert_array_equal(fd.x[3], [bos, 1, oov, eos, PAD])  # 00's test row last
    np.testing.assert_array_equal([len(_client_rows(fd, k)) for k in range(3)], [4, 2, 2])
    pop = load_population("tff_stackoverflow", num_clients=3, seed=0, data_root=str(tmp_path),
                          dataset_params=params)
    win = pop.clients([0, 1, 2])
    assert win.x.dtype == np.int64 and pop.vocab_size == 7 and pop.target_shape == (5,)
    np.testing.assert_array_equal(win.x, fd.x)
    np.testing.assert_array_equal(win.y, fd.y)
    capped = _load("tff_stackoverflow", tmp_path, 3, max_client_samples=2, **params)
    assert [len(_client_rows(capped, k)) for k in range(3)] == [2, 2, 2]


def test_tff_stackoverflow_word_count_file(tmp_path):
    tff = _stackoverflow(tmp_path, {"u": ["x y z", "y"]}, {})
    (tff / "stackoverflow.word_count").write_text("z 10\nx 5\ny 1\n")
    fd = _load("tff_stackoverflow", tmp_path, 1, vocab_size=2, sequence_length=4)
    np.testing.assert_array_equal(fd.x[0], [4, 2, 3, 1])  # bos, x, y (OOV=3), z
    (tff / "stackoverflow.word_count").write_text("z ten\n")
    with pytest.raises(DataError, match="line 1 is not 'word count'"):
        _load("tff_stackoverflow", tmp_path, 1)


def test_tff_cifar100_distinct_test_clients_and_labels(tmp_path):
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)
    fine = rng.integers(0, 100, 7)
    tff = tmp_path / "tff"
    _h5(tff / "fed_cifar100_train.h5", {"0": {"image": img[:3], "label": fine[:3],
                                              "coarse_label": fine[:3] // 5},
                                        "1": {"image": img[3:5], "label": fine[3:5],
                                              "coarse_label": fine[3:5] // 5}})
    _h5(tff / "fed_cifar100_test.h5", {"0": {"image": img[5:], "label": fine[5:],
                                             "coarse_label": fine[5:] // 5}})
    fd = _load("tff_cifar100", tmp_path, 3)
    assert fd.x.shape == (7, 3, 32, 32) and fd.num_classes == 100
    assert [len(_client_rows(fd, k)) for k in range(3)] == [3, 2, 2]  # test "0" is client 2
    np.testing.assert_allclose(fd.x, img.transpose(0, 3, 1, 2) / 255, rtol=1e-6)
    coarse = _load("tff_cifar100", tmp_path, 2, label="coarse", normalise="per_image")
    assert coarse.num_classes == 20
    np.testing.assert_array_equal(coarse.y, fine[:5] // 5)
    flat = coarse.x.reshape(5, -1)
    np.testing.assert_allclose(flat.mean(1), 0, atol=1e-5)
    np.testing.assert_allclose(flat.std(1), 1, atol=1e-3)


def test_tff_missing_file_bad_file_and_checksum(tmp_path):
    with pytest.raises(DataError) as err:
        _load("tff_emnist", tmp_path, 1)
    msg = str(err.value)
    assert "\n" not in msg and "fed_emnist_train.h5" in msg and "fed_emnist.tar.bz2" in msg
    assert "storage.googleapis.com/tff-datasets-public" in msg
    tff = tmp_path / "tff"
    tff.mkdir()
    (tff / "fed_emnist_train.h5").write_bytes(b"not hdf5")
    (tff / "fed_emnist_test.h5").write_bytes(b"not hdf5")
    with pytest.raises(DataError, match=r"cannot read .*fed_emnist_train\.h5: not a readable"):
        _load("tff_emnist", tmp_path, 1)
    with h5py.File(tff / "fed_emnist_train.h5", "w") as f:
        f["other/x"] = np.zeros(2)
    with pytest.raises(DataError, match="has no group '/examples'"):
        _load("tff_emnist", tmp_path, 1)
    tar = tff / "fed_emnist.tar.bz2"
    tar.write_bytes(b"damaged")
    with pytest.raises(DataError, match=r"sha256 .*TFF publishes fe1ed5a5"):
        _load("tff_emnist", tmp_path, 1)
    assert hashlib.sha256(b"damaged").hexdigest() != TARBALLS["tff_emnist"][0][1]


def test_tff_missing_feature_is_one_line(tmp_path):
    _h5(tmp_path / "tff" / "fed_emnist_train.h5", {"a": {"pixels": np.zeros((2, 28, 28),
                                                                             np.float32)}})
    _h5(tmp_path / "tff" / "fed_emnist_test.h5", {})
    with pytest.raises(DataError, match="'/examples/a/label' is missing"):
        _load("tff_emnist", tmp_path, 1)


# --------------------------------------------------------------------------- FLAIR

def _flair(path, users, classes=4):
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for (part, uid), (images, labels) in users.items():
            rows = [j for j, ls in enumerate(labels) for _ in ls]
            cols = [c for ls in labels for c in ls]
            f[f"/{part}/{uid}/images"] = images
            f[f"/{part}/{uid}/labels_row"] = np.asarray(rows, dtype=np.uint16)
            f[f"/{part}/{uid}/labels_col"] = np.asarray(cols, dtype=np.uint8)
            f[f"/{part}/{uid}/image_ids"] = np.asarray([b"id"] * len(images), dtype="S")
        f["/metadata/label_mapping"] = json.dumps({f"l{i}": i for i in range(classes)})


def test_flair_multi_hot_targets(tmp_path):
    rng = np.random.default_rng(4)
    img = rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    _flair(tmp_path / "flair" / "flair_federated.hdf5", {
        ("train", "u1"): (img[:2], [[0, 3], [1]]),
        ("val", "u3"): (img[:1], [[0]]),  # 1 image: skipped
        ("test", "u2"): (img[2:5], [[2], [], [0, 1, 2]])})
    fd = _load("flair", tmp_path, 2)
    assert fd.x.shape == (5, 3, 8, 8) and fd.x.dtype == np.float32
    assert fd.y.shape == (5, 4) and fd.y.dtype == np.float32 and fd.num_classes == 4
    np.testing.assert_array_equal(fd.y, [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 1, 0],
                                         [0, 0, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_allclose(fd.x, img.transpose(0, 3, 1, 2) / 255, rtol=1e-6)
    with pytest.raises(DataError, match="1 clients with at least 2 samples"):
        _load("flair", tmp_path, 2, partitions=["test"])


def test_flair_missing_file_and_bad_mapping(tmp_path):
    with pytest.raises(DataError) as err:
        _load("flair", tmp_path, 1)
    assert "flair_federated.hdf5" in str(err.value) and "pfl-research" in str(err.value)
    path = tmp_path / "flair" / "flair_federated.hdf5"
    _flair(path, {(p, "u"): (np.zeros((2, 4, 4, 3), np.uint8), [[0], [1]])
                  for p in ("train", "val", "test")})
    with h5py.File(path, "a") as f:
        del f["/metadata/label_mapping"]
    with pytest.raises(DataError, match="label_mapping' must be a JSON object"):
        _load("flair", tmp_path, 1)
