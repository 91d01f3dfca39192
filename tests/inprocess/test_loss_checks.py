"""The loss checked at set-up against the run's own targets (shape, dtype, classes) and on the
model's own output, the model judged by what it does on the run's samples, and
``[model.params]`` never colliding with what mpifl passes: each mistake one line naming the
loss or model, the data set and the mismatch, before anything trains. Runs in-process
(``mpifl.run``) on the generated stand-ins, real files in TFF's layout, and a plugin written
to a temporary folder."""

from __future__ import annotations

import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpifl
from mpifl.core.errors import ConfigError
from mpifl.models import get_loss
from mpifl.models.losses import check_targets
from mpifl.models.zoo import factory_keywords

ROOT = Path(__file__).resolve().parents[2]

#: a plugin of this test: a char-LSTM that takes its vocabulary from num_classes (its signature
#: never names vocab_size), a float model whose first layer is a Linear, and a user loss that
#: scores one label a sample
PLUGIN = textwrap.dedent('''
    import torch.nn.functional as F
    from torch import nn

    from mpifl.plugin import register_model


    class NextChar(nn.Module):
        def __init__(self, classes):
            super().__init__()
            self.embed = nn.Embedding(classes, 4)
            self.rnn = nn.GRU(4, 8, batch_first=True)
            self.out = nn.Linear(8, classes)

        def forward(self, x):
            h, _ = self.rnn(self.embed(x))
            return self.out(h[:, -1])


    @register_model("loss_checks_next_char")
    def next_char(input_shape, num_classes, *, seed):
        # ids 0..V-1 of the data set and the classes it predicts are the same characters
        return NextChar(num_classes)


    @register_model("loss_checks_linear")
    def linear(input_shape, num_classes, *, seed):
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))


    def one_label_loss(out, y):
        return F.cross_entropy(out, y, reduction="none")
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("loss-checks-plugin")
    (folder / "loss_checks_plugin.py").write_text(PLUGIN)
    return {"modules": ["loss_checks_plugin"], "path": [str(folder)]}


def _tables(dataset: str, model: dict, num_clients: int = 3, **data) -> dict:
    return {"run": {"rounds": 1, "eval_every": 1, "checkpoint_every": 0, "threads": 1},
            "data": {"dataset": dataset, "partition": "natural", "num_clients": num_clients,
                     **data},
            "model": model,
            "client": {"batch_size": 8, "lr": 0.1},
            "server": {"algorithm": "fedavg", "clients_per_round": 2}}


def _refused(tables: dict, tmp_path: Path, overrides: dict | None = None,
             config: object = None) -> str:
    """The one-line ConfigError of a run refused at set-up (no results file)."""
    out = tmp_path / "refused.h5"
    with pytest.raises(ConfigError) as err:
        mpifl.run(tables if config is None else config, out=out, overrides=overrides or {},
                  progress=False)
    assert "\n" not in str(err.value) and not out.exists()
    return str(err.value)


def _model(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        return f["model/global"][()]


def _accuracy(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["eval/client_accuracy"][()]


SMALL_LSTM = {"hidden_size": 8, "embedding_dim": 4, "num_layers": 1}
TINY_LM = {"embedding_size": 8, "hidden_size": 8, "num_heads": 1, "feedforward_size": 8,
           "num_layers": 1, "dropout": 0.0}


# --------------------------------------------------------------------------- loss vs targets


def test_cross_entropy_on_sequence_targets_names_the_loss_and_the_targets(tmp_path):
    message = _refused(_tables("stackoverflow_like", {"name": "transformer_lm",
                                                      "loss": "cross_entropy",
                                                      "params": TINY_LM}), tmp_path)
    assert message.startswith("model.loss: 'cross_entropy' needs one integer class label")
    assert "data set 'stackoverflow_like' has a sequence of 20 token targets" in message
    assert "(8, 20) int64" in message and "'token_cross_entropy'" in message


def test_token_cross_entropy_on_one_label_a_sample_names_the_fitting_loss(tmp_path):
    message = _refused(_tables("shakespeare_like", {
        "name": "char_lstm", "loss": "token_cross_entropy",
        "params": {**SMALL_LSTM, "sequence": False}}), tmp_path)
    assert message.startswith("model.loss: 'token_cross_entropy' needs a sequence")
    assert "data set 'shakespeare_like' has one class label a sample (y (8,) int64)" in message
    assert "'cross_entropy'" in message


def test_targets_are_checked_for_dtype_shape_and_classes():
    ce, ml = get_loss("cross_entropy"), get_loss("multilabel_bce")
    check_targets(ce, np.array([0, 2, 1]), 3, "toy")  # fits: nothing raised
    with pytest.raises(ConfigError, match=r"needs class ids 0\.\.2, but data set 'toy' has "
                                          r"targets 0\.\.5"):
        check_targets(ce, np.array([0, 5, 1]), 3, "toy")
    with pytest.raises(ConfigError, match=r"'cross_entropy' needs one integer class label .* "
                                          r"float targets of shape \(\) .* 'mse'"):
        check_targets(ce, np.array([0.5, 1.5], np.float32), 3, "toy")
    hot = np.array([[1, 0, 1], [0, 0, 0]], np.float32)
    check_targets(ml, hot, 3, "toy")
    with pytest.raises(ConfigError, match=r"needs 4 multi-hot .* data set 'toy' has 3 "
                                          r"multi-hot 0/1 labels a sample"):
        check_targets(ml, hot, 4, "toy")  # the width must be the data set's C
    with pytest.raises(ConfigError, match=r"needs multi-hot 0/1 labels, but data set 'toy' "
                                          r"has other values"):
        check_targets(ml, hot * 0.5, 3, "toy")
    with pytest.raises(ConfigError, match=r"'multilabel_bce' needs 3 multi-hot .* one class "
                                          r"label a sample"):
        check_targets(ml, np.array([0, 1]), 3, "toy")


def test_a_user_loss_that_fails_on_the_targets_is_named_with_the_shapes(tmp_path, plugin):
    tables = _tables("stackoverflow_like", {"name": "transformer_lm",
                                            "loss": "loss_checks_plugin:one_label_loss",
                                            "params": TINY_LM})
    message = _refused({**tables, "plugins": plugin}, tmp_path)
    assert message.startswith("model.loss: 'loss_checks_plugin:one_label_loss' "
                              "(loss_checks_plugin:one_label_loss) fails on model "
                              "'transformer_lm''s output (8, 20, 10004) float32 against data "
                              "set 'stackoverflow_like''s targets (8, 20) int64: RuntimeError")


# --------------------------------------------------------------------------- TFF Shakespeare


def write_tff_shakespeare(root: Path, roles: int = 6, seed: int = 0) -> None:
    """TFF's layout (examples/<role>/snippets, variable-length UTF-8 strings) in
    ``root/tff/shakespeare_{train,test}.h5``: each role repeats a phrase of its own, so the
    next character is learnable."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz ,.")
    for part, count in (("train", 3), ("test", 1)):
        path = root / "tff" / f"shakespeare_{part}.h5"
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(path, "w") as f:
            for r in range(roles):
                phrase = "".join(np.random.default_rng(r).choice(letters, 7))
                snippets = [phrase * int(rng.integers(8, 30)) for _ in range(count)]
                f.create_dataset(f"examples/ROLE_{r}/snippets", data=snippets,
                                 dtype=h5py.string_dtype(encoding="utf-8"))


def test_the_leaf_job_on_tff_shakespeare_is_refused_and_the_tff_job_runs(tmp_path):
    write_tff_shakespeare(tmp_path)
    shrink = {"data.dataset": "tff_shakespeare", "data.data_root": str(tmp_path),
              "data.num_clients": 6, "server.clients_per_round": 3, "run.rounds": 2,
              "run.eval_every": 1, "run.threads": 1,
              **{f"model.params.{k}": v for k, v in SMALL_LSTM.items()}}
    message = _refused({}, tmp_path, shrink, config=ROOT / "jobs" / "leaf-shakespeare.toml")
    assert message.startswith("model.loss: 'cross_entropy' needs one integer class label")
    assert "data set 'tff_shakespeare' has a sequence of 80 token targets" in message
    assert "'token_cross_entropy'" in message and "sequence = true" in message
    out = tmp_path / "tff.h5"
    mpifl.run(ROOT / "jobs" / "tff-shakespeare.toml", out=out, overrides=shrink,
              progress=False)
    acc = _accuracy(out)
    assert acc.shape == (2, 6) and np.isfinite(acc).all()
    assert ((0 <= acc) & (acc <= 1)).all()


# --------------------------------------------------------------------------- model params


def test_a_users_vocab_size_never_collides_with_mpifls(tmp_path):
    model = {"name": "char_lstm", "params": {**SMALL_LSTM, "sequence": False}}
    plain, same = tmp_path / "plain.h5", tmp_path / "same.h5"
    mpifl.run(_tables("shakespeare_like", model), out=plain, progress=False)
    # the data set's own V (shakespeare_like: 81 ids) is let through: the very same run
    mpifl.run(_tables("shakespeare_like", model), out=same, progress=False,
              overrides={"model.params.vocab_size": 81})
    assert np.array_equal(_model(plain), _model(same))
    message = _refused(_tables("shakespeare_like", model), tmp_path,
                       {"model.params.vocab_size": 80})
    assert message.startswith("model.params.vocab_size = 80: data set 'shakespeare_like' "
                              "holds token ids 0..80")
    assert "remove the key" in message
    message = _refused(_tables("shakespeare_like", model), tmp_path, {"model.params.seed": 4})
    assert message.startswith("model.params.seed: mpifl passes 'seed' to model 'char_lstm' "
                              "itself (from run.seed)")


def test_vocab_size_on_float_features_is_an_ordinary_factory_keyword():
    # char_lstm names vocab_size: the user's value is what it gets, not a collision
    assert factory_keywords("char_lstm", {"vocab_size": 5, "hidden_size": 8}, None, "toy") \
        == ({"hidden_size": 8}, 5)
    # a data set of token ids: its own V is passed, an equal user value changes nothing
    assert factory_keywords("char_lstm", {"vocab_size": 81}, 81, "toy") == ({}, 81)
    with pytest.raises(ConfigError, match=r"^unknown key 'model.params.vocab_size': model "
                                          r"'mlp' takes no parameter 'vocab_size'"):
        factory_keywords("mlp", {"vocab_size": 5}, None, "toy")  # never silently dropped


def test_a_token_model_on_float_features_names_model_and_data_set(tmp_path):
    message = _refused(_tables("synthetic", {"name": "char_lstm", "params": SMALL_LSTM},
                               num_clients=4), tmp_path)
    assert message.startswith("model 'char_lstm' embeds token ids (its factory needs "
                              "vocab_size), but data set 'synthetic' holds float features")


# --------------------------------------------------------------------------- by what it does


def test_a_model_is_judged_by_what_it_does_on_the_runs_token_ids(tmp_path, plugin):
    # no vocab_size in its signature, but it embeds the ids: accepted, trained, evaluated
    out = tmp_path / "next-char.h5"
    tables = {**_tables("shakespeare_like", {"name": "loss_checks_next_char"}),
              "plugins": plugin}
    tables["run"]["rounds"] = 2
    mpifl.run(tables, out=out, progress=False)
    acc = _accuracy(out)
    assert acc.shape == (2, 3) and np.isfinite(acc).all()
    # a Linear on int64 ids fails on the run's own samples: refused, naming model and data set
    tables = {**_tables("shakespeare_like", {"name": "loss_checks_linear"}),
              "plugins": plugin}
    message = _refused(tables, tmp_path)
    assert message.startswith("model 'loss_checks_linear' takes float features, but data set "
                              "'shakespeare_like' holds token ids: on the run's samples "
                              "((8, 80) int64) it fails: RuntimeError")
