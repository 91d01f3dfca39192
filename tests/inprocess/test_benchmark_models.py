"""The federated benchmarks' models (ALGORITHMS.md §9): LEAF's FEMNIST CNN and Shakespeare LSTM,
pfl-research's StackOverflow transformer, ResNet-18 with GroupNorm; their published sizes and
shapes, and their training on the vectorised path against the per-client loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.clients.interface import TrainOptions
from mpifl.clients.loop import LoopTrainer
from mpifl.clients.select import select_trainer
from mpifl.clients.trainer import VmapTrainer
from mpifl.core.errors import ConfigError
from mpifl.core.layout import ParamLayout
from mpifl.data.registry import PAD
from mpifl.models import build_model, get_loss, model_traits
from tests.helpers import train

V, T = 11, 6  # a tiny vocabulary (0 is padding) and sequence length


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _tokens(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, T) ids in 1..V-1, (n,) next-token labels, (n, T) sequence targets with PAD tails."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (n, T), generator=g)
    seq = torch.randint(1, V, (n, T), generator=g)
    seq[::3, T - 2:] = PAD
    return x, torch.randint(1, V, (n,), generator=g), seq


# --------------------------------------------------------------------------- sizes and shapes


def test_cnn_femnist_has_leafs_published_parameter_count():
    model = build_model("cnn_femnist", (1, 28, 28), 62)
    assert _count(model) == 6_603_710  # Caldas et al., LEAF (2018)
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 62)
    flat = build_model("cnn_femnist", (28, 28), 62)  # (H, W) grey images take the same model
    assert _count(flat) == 6_603_710 and flat(torch.zeros(2, 28, 28)).shape == (2, 62)
    with pytest.raises(ConfigError, match="cnn_femnist needs grey images"):
        build_model("cnn_femnist", (3, 28, 28), 62)


def test_resnet18_gn_is_resnet18_with_groupnorm():
    # torchvision's ResNet-18 has 11,689,512 parameters at 1000 classes (He et al., 2016);
    # GroupNorm has BatchNorm's affine parameters and no running statistics.
    model = build_model("resnet18_gn", (3, 24, 24), 1000)
    assert _count(model) == 11_689_512 and not list(model.buffers())
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == 20 and all(m.num_groups == 2 for m in norms)  # 17 + 3 shortcuts
    for shape in ((3, 24, 24), (3, 32, 32)):
        for stem in ("imagenet", "cifar"):
            net = build_model("resnet18_gn", shape, 100, stem=stem)
            assert net(torch.randn(2, *shape)).shape == (2, 100)
    cifar = build_model("resnet18_gn", (3, 32, 32), 1000, stem="cifar")
    assert _count(cifar) == 11_689_512 - 64 * 3 * (7 * 7 - 3 * 3)  # 3x3 stem conv, not 7x7
    with pytest.raises(ConfigError, match="groups 3 must divide width 64"):
        build_model("resnet18_gn", (3, 24, 24), 100, groups=3)


def test_char_lstm_is_leafs_and_predicts_after_or_at_every_position():
    x, _, _ = _tokens(4)
    leaf = build_model("char_lstm", (80,), 80, vocab_size=80, sample=torch.randint(1, 80, (2, 80)))
    # LEAF's Shakespeare LSTM: Embedding(80, 8), LSTM(8 -> 256), LSTM(256 -> 256), Dense(80)
    lstm = 4 * 256 * (8 + 256 + 2) + 4 * 256 * (256 + 256 + 2)
    assert _count(leaf) == 80 * 8 + lstm + 256 * 80 + 80
    last = build_model("char_lstm", (T,), V, vocab_size=V, sample=x, hidden_size=8)
    every = build_model("char_lstm", (T,), V, vocab_size=V, sample=x, hidden_size=8,
                        sequence=True, sequence_targets=True)
    assert last(x).shape == (4, V) and every(x).shape == (4, T, V)
    torch.testing.assert_close(every(x)[:, -1], last(x))  # same seed, same weights


def test_transformer_lm_has_pfl_research_sizes_and_is_causal():
    x, _, _ = _tokens(4)
    model = build_model("transformer_lm", (T,), V, vocab_size=V, sample=x,
                        sequence_targets=True)
    # embedding 96 (tied output), 3 layers of: attention 4 * (96^2 + 96), feed-forward
    # 96 -> 1536 -> 96, two LayerNorms
    layer = 4 * (96 * 96 + 96) + (96 * 1536 + 1536) + (1536 * 96 + 96) + 4 * 96
    assert _count(model) == V * 96 + 3 * layer and not list(model.buffers())
    small = build_model("transformer_lm", (T,), V, vocab_size=V, sample=x,
                        sequence_targets=True, embedding_size=8, hidden_size=16, num_heads=2,
                        feedforward_size=16, num_layers=1, dropout=0.0).eval()
    changed = x.clone()
    changed[:, 3] = x[:, 3] % (V - 1) + 1  # another token at position 3
    before, after = small(x), small(changed)
    torch.testing.assert_close(before[:, :3], after[:, :3])  # earlier positions cannot see it
    assert not torch.allclose(before[:, 3:], after[:, 3:])
    with pytest.raises(ConfigError, match="tie_embeddings = false"):
        build_model("transformer_lm", (T,), V + 1, vocab_size=V, sample=x,
                    sequence_targets=True)
    untied = build_model("transformer_lm", (T,), V + 1, vocab_size=V, sample=x,
                         sequence_targets=True, tie_embeddings=False, num_layers=1)
    assert untied(x).shape == (4, T, V + 1)


def test_models_are_deterministic_in_the_seed():
    x, _, _ = _tokens(4)
    cases = [("cnn_femnist", (1, 12, 12), {}, dict(hidden=8)),
             ("char_lstm", (T,), dict(vocab_size=V, sample=x), dict(hidden_size=8)),
             ("transformer_lm", (T,), dict(vocab_size=V, sample=x, sequence_targets=True),
              dict(num_layers=1)),
             ("resnet18_gn", (3, 12, 12), {}, dict(width=4, blocks=(1, 1)))]
    for name, shape, data, params in cases:
        classes = V if data else 5
        w = [ParamLayout.from_module(m).flatten_module(m) for m in
             (build_model(name, shape, classes, seed=s, **data, **params) for s in (3, 3, 4))]
        assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2]), name


# --------------------------------------------------------------------------- training paths


def _clients(sizes):
    bounds = np.cumsum([0, *sizes])
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _small(name):
    """(model, x, y, loss) of a small instance of each benchmark model, random data."""
    g = torch.Generator().manual_seed(1)
    x, labels, seq = _tokens(28)
    if name == "cnn_femnist":
        x = torch.randn(28, 1, 12, 12, generator=g)
        return build_model(name, (1, 12, 12), 5, seed=1, hidden=16), x, labels % 5, \
            "cross_entropy"
    if name == "resnet18_gn":
        x = torch.randn(28, 3, 16, 16, generator=g)
        return build_model(name, (3, 16, 16), 5, seed=1, width=4, blocks=(1, 1, 1)), x, \
            labels % 5, "cross_entropy"
    if name == "char_lstm":
        return build_model(name, (T,), V, seed=1, vocab_size=V, sample=x[:4], hidden_size=8,
                           embedding_dim=4), x, labels, "cross_entropy"
    if name == "char_lstm_seq":
        return build_model("char_lstm", (T,), V, seed=1, vocab_size=V, sample=x[:4],
                           sequence_targets=True, hidden_size=8, embedding_dim=4,
                           sequence=True), x, seq, "token_cross_entropy"
    return build_model(name, (T,), V, seed=1, vocab_size=V, sample=x[:4], sequence_targets=True,
                       embedding_size=8, hidden_size=16, num_heads=2, feedforward_size=16,
                       num_layers=2, dropout=0.0), x, seq, "token_cross_entropy"


@pytest.mark.parametrize("name", ["cnn_femnist", "resnet18_gn", "char_lstm", "char_lstm_seq",
                                  "transformer_lm"])
def test_vmap_trains_the_benchmark_models_as_the_loop_does(name):
    """Every model here is a deterministic function without buffers (the transformer with
    dropout 0), so the vectorised path must give the loop's updates up to float rounding of
    differently batched kernels (observed <= 2e-7 on updates of ~0.1-0.3)."""
    model, x, y, loss = _small(name)
    traits = model_traits(model, tuple(x.shape[1:]), x[:4])
    assert traits.vmappable
    layout = ParamLayout.from_module(model)
    w = layout.flatten_module(model)
    idx, ids = _clients((7, 12, 9)), np.array([4, 0, 2])
    kw = dict(epochs=2, batch_size=4, momentum=0.5, weight_decay=1e-3, loss=get_loss(loss))
    got = train(VmapTrainer(model, layout, x, y, TrainOptions(**kw)), w, 3, 0.1, ids, idx)
    want = train(LoopTrainer(model, layout, x, y, TrainOptions(**kw)), w, 3, 0.1, ids, idx)
    assert want[0].abs().max() > 1e-2  # the clients did move
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def test_auto_picks_the_loop_for_operators_vmap_runs_one_client_at_a_time():
    """On a CPU, torch.func.vmap has no batching rule for the LSTM kernel nor for the CPU
    attention kernel: exact, but one client at a time, so ``auto`` takes the loop."""
    for name in ("char_lstm", "transformer_lm"):
        model, x, _, _ = _small(name)
        traits = model_traits(model, (T,), x[:4])
        assert traits.vmappable and traits.unbatched, name
        assert select_trainer("auto", traits, "sgd", "cpu")[0] == "loop"
        assert select_trainer("vmap", traits, "sgd", "cpu")[0] == "vmap"  # allowed, exact
    model, x, _, _ = _small("resnet18_gn")
    traits = model_traits(model, (3, 16, 16), x[:4])
    assert traits.vmappable and not traits.unbatched and traits.convolutional


def test_transformer_with_dropout_trains_in_the_loop_and_vmap_refuses_it():
    x, _, _ = _tokens(60, seed=2)
    seq = x % (V - 1) + 1  # learnable under the causal mask: a fixed map of the current token
    seq[::2, -2:] = PAD
    model = build_model("transformer_lm", (T,), V, seed=0, vocab_size=V, sample=x[:4],
                        sequence_targets=True, embedding_size=16, hidden_size=16, num_heads=2,
                        feedforward_size=32, num_layers=1)  # pfl-research's dropout 0.1
    traits = model_traits(model, (T,), x[:4])
    assert traits.random
    with pytest.raises(ConfigError, match="'vmap' cannot train this model exactly"):
        select_trainer("vmap", traits, "sgd", "cpu")
    assert select_trainer("auto", traits, "sgd", "cuda")[0] == "loop"
    layout = ParamLayout.from_module(model)
    trainer = LoopTrainer(model, layout, x, seq, TrainOptions(
        epochs=1, batch_size=10, loss=get_loss("token_cross_entropy")), random=True)
    w, idx, losses = layout.flatten_module(model), _clients((20, 20, 20)), []
    for rnd in range(6):  # FedAvg: the mean of three equal clients' updates
        updates, loss = train(trainer, w, rnd, 0.5, np.arange(3), idx)
        losses.append(float(loss.mean()))
        w = w - updates.mean(dim=0)
    assert losses[-1] < 0.8 * losses[0], losses
