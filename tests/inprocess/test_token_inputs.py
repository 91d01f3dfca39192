"""Token inputs: data sets of (N, T) int64 token ids, sequence targets with the padding id, the
``token_cross_entropy`` loss, a model check on the run's own samples, and plugin models (a
char-LSTM, a small transformer) trained, evaluated and resumed exactly from a folder outside
the repository, on one process and on 3 MPI ranks (the runs come from the shared MPI world,
tests/world.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpifl.core.errors import ConfigError, DataError
from mpifl.data.registry import PAD, DataPool, DataShape
from mpifl.models import get_loss
from mpifl.models.zoo import build_model, model_params, model_traits

from tests.world import world_run

PLUGIN = textwrap.dedent('''
    """Toy text for mpifl's tests: per-client Markov chains over 12 characters."""
    import numpy as np
    import torch
    from torch import nn

    from mpifl.data.registry import CLIENTS, LABELS, DataPool
    from mpifl.plugin import register_dataset, register_model

    V, T, K, N = 13, 10, 12, 40  # ids 1..12 (0 is padding), length, clients, samples a client


    def _chains(seed, sequence):
        rng = np.random.default_rng(seed)
        nxt = rng.integers(1, V, size=V)  # the shared next-character table
        x = np.zeros((K * N, T), np.int64)
        y = np.zeros((K * N, T) if sequence else K * N, np.int64)
        for i in range(K * N):
            c = rng.integers(1, V)
            for t in range(T + 1):
                c = nxt[c] if rng.random() < 0.8 else rng.integers(1, V)
                if t < T:
                    x[i, t] = c
                if sequence and t > 0:
                    y[i, t - 1] = c
                elif not sequence and t == T:
                    y[i] = c
        if sequence:  # padded tails: the loss and accuracy skip them
            x[::3, 7:], y[::3, 6:] = 0, 0
        return x, y


    @register_dataset("toy_chars", provides=(LABELS, CLIENTS))
    def toy_chars(*, seed, data_root=None):
        x, y = _chains(seed, False)
        return DataPool(x, y, V, client_sizes=np.full(K, N), vocab_size=V)


    @register_dataset("toy_sequences", provides=(CLIENTS,))
    def toy_sequences(*, seed, data_root=None):
        x, y = _chains(seed, True)
        return DataPool(x, y, V, client_sizes=np.full(K, N), vocab_size=V)


    class CharLSTM(nn.Module):
        def __init__(self, vocab_size, classes, hidden):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, 8)
            self.lstm = nn.LSTM(8, hidden, batch_first=True)
            self.out = nn.Linear(hidden, classes)

        def forward(self, x):
            h, _ = self.lstm(self.embed(x))
            return self.out(h[:, -1])


    @register_model("toy_lstm")
    def toy_lstm(input_shape, num_classes, *, seed, vocab_size, hidden=16):
        # ``hidden`` is this plugin's own int: the built-in mlp's model.hidden must not reach it
        return CharLSTM(vocab_size, num_classes, int(hidden))


    class TinyTransformer(nn.Module):
        def __init__(self, vocab_size, classes, width, length):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, width)
            self.pos = nn.Parameter(torch.zeros(length, width))
            layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0,
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.out = nn.Linear(width, classes)

        def forward(self, x):
            causal = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), 1)
            return self.out(self.encoder(self.embed(x) + self.pos, mask=causal))


    @register_model("toy_transformer")
    def toy_transformer(input_shape, num_classes, *, seed, vocab_size, hidden=16):
        return TinyTransformer(vocab_size, num_classes, int(hidden), input_shape[0])
''')

JOB = textwrap.dedent('''
    [plugins]
    modules = ["toy_text"]
    [data]
    dataset = "toy_chars"
    partition = "natural"
    num_clients = 12
    [model]
    name = "toy_lstm"
    [model.params]
    hidden = 16
    [client]
    batch_size = 8
    lr = 0.5
    [server]
    algorithm = "fedavg"
    clients_per_round = 6
    [run]
    rounds = 6
    eval_every = 2
    checkpoint_every = 2
    threads = 1
''')


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "toy_text.py").write_text(PLUGIN)
    (folder / "job.toml").write_text(JOB)
    return folder


#: the plugin and the job side by side in the shared MPI world's folder (tests/world.py)
FILES = {"toy_text.py": PLUGIN, "tokens.toml": JOB}


def _run(name: str, ranks: int, *sets: str):
    """A world run of the job with ``--set`` words ``sets``; its results ``{name}.h5``."""
    words = [x for s in sets for x in ("--set", s)]
    return world_run(name, ["run", "{dir}/tokens.toml", *words, "--out", f"{{dir}}/{name}.h5",
                            "--no-progress"], ranks=ranks, files=FILES)


LSTM = {ranks: _run(f"tokens-lstm-{ranks}", ranks) for ranks in (1, 3)}
LSTM_PART = _run("tokens-lstm-part", 3, "run.rounds=2")
LSTM_RESUMED = world_run("tokens-lstm-resumed", ["resume", "{dir}/tokens-lstm-part.h5",
                                                 "--rounds", "6", "--no-progress"], ranks=3)
SEQUENCES = ["data.dataset=toy_sequences", "model.name=toy_transformer",
             "model.loss=token_cross_entropy", "run.rounds=4", "client.lr=0.3"]
TRAINERS = {trainer: _run(f"tokens-sequences-{trainer}", 1, *SEQUENCES,
                          f"client.trainer={trainer}") for trainer in ("loop", "vmap")}


def _model(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["model/global"][()]


def _eval(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["eval/mean"][()]


# --------------------------------------------------------------------------- the data contract


def test_token_pools_are_checked_in_one_line():
    x = np.array([[1, 2, 0], [3, 1, 2]], np.int64)
    ok = DataPool(x, np.array([1, 2]), 4, client_sizes=np.array([2]), vocab_size=4).check("t")
    assert ok.x.dtype == np.int64 and ok.vocab_size == 4
    seq = DataPool(x, np.array([[2, 0, 0], [1, 2, 0]]), 4, vocab_size=4).check("t")
    assert "labels" not in seq.provides()  # no label a sample: no label-based partition
    bad = [(DataPool(x, np.array([1, 2]), 4), "token inputs must be .* vocab_size >= 2"),
           (DataPool(x, np.array([1, 2]), 4, vocab_size=3), r"token ids must lie in 0..vocab"),
           (DataPool(x.astype(np.float32), np.array([1, 2]), 4, vocab_size=4),
            "vocab_size is for token inputs"),
           (DataPool(x, np.array([[1, 9, 0], [1, 1, 1]]), 4, vocab_size=4),
            "labels must lie in 0..num_classes-1")]
    for pool, message in bad:
        with pytest.raises(DataError, match=f"data set 't': {message}"):
            pool.check("t")


def test_token_cross_entropy_skips_padding():
    loss = get_loss("token_cross_entropy")
    out = torch.randn(2, 4, 5)
    y = torch.tensor([[1, 2, PAD, PAD], [3, 4, 1, 2]])
    direct = [torch.nn.functional.cross_entropy(out[0, :2], y[0, :2]),
              torch.nn.functional.cross_entropy(out[1], y[1])]
    torch.testing.assert_close(loss.per_sample(out, y), torch.stack(direct))
    right = out.argmax(-1) == y
    want = torch.tensor([right[0, :2].float().mean(), right[1].float().mean()], dtype=torch.float64)
    torch.testing.assert_close(loss.hits(out, y), want)


def test_declared_shapes_count_token_ids_at_eight_bytes():
    shape = DataShape((80,), 81, samples_per_client=100.0, vocab_size=81, target_shape=(80,))
    assert shape.num_samples(10) == 1000.0 and shape.sample_bytes() == 80 * 8 + 80 * 8
    images = DataShape((1, 28, 28), 62, samples=1000)
    assert images.num_samples(5) == 1000.0 and images.sample_bytes() == 4 * 784 + 8


# --------------------------------------------------------------------------- the model check


def test_model_check_runs_on_the_runs_own_token_ids(outside, monkeypatch):
    monkeypatch.syspath_prepend(str(outside))
    import toy_text

    x, y = toy_text._chains(0, False)
    sample = torch.from_numpy(x[:8])
    model = build_model("toy_lstm", (10,), 13, vocab_size=13, sample=sample, hidden=8)
    traits = model_traits(model, (10,), sample)
    assert not traits.buffers and not traits.random
    assert traits.unbatched  # nn.LSTM has no vmap batching rule on a CPU: auto picks the loop
    # a plugin's parameters come from its own [model.params] only, never model.hidden
    own = build_model("toy_lstm", (10,), 13, vocab_size=13, sample=sample,
                      **model_params("toy_lstm", [200, 200], {}))
    assert own.lstm.hidden_size == 16
    assert model_params("mlp", [200, 200], {}) == {"hidden": (200, 200)}
    with pytest.raises(ConfigError, match="model 'mlp' takes float features, but the data set "
                                          "holds token ids"):
        build_model("mlp", (10,), 13, vocab_size=13, sample=sample, hidden=(8,))
    with pytest.raises(ConfigError, match=r"output shape \(8, 13\) .* expected \(8, 10, 13\)"):
        build_model("toy_lstm", (10,), 13, vocab_size=13, sample=sample,
                    sequence_targets=True, hidden=8)


# --------------------------------------------------------------------------- whole runs


def test_char_lstm_plugin_trains_on_three_ranks_and_resumes_exactly(world):
    one, three = world.file(LSTM[1]), world.file(LSTM[3])
    assert "loop trainer" in world.output(LSTM[1])  # no vmap batching rule for the LSTM on a CPU
    assert np.array_equal(_model(one), _model(three))
    assert world.status(LSTM_PART) == 0  # 2 rounds on 3 ranks, resumed to 6
    assert np.array_equal(_model(world.file(LSTM_RESUMED, "tokens-lstm-part.h5")),
                          _model(three))
    acc = _eval(one)
    assert acc[-1] > 3 / 12  # it learns the chains (chance: 1/12)


def test_sequence_targets_train_vmap_equal_to_the_loop(world):
    loop, vmapped = world.file(TRAINERS["loop"]), world.file(TRAINERS["vmap"])
    np.testing.assert_allclose(_model(vmapped), _model(loop), rtol=0, atol=1e-4)
    acc = _eval(loop)
    assert np.isfinite(acc).all() and acc[-1] > acc[0]
