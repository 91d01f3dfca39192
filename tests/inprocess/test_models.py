"""Model zoo and parameter layout: sizes, layer map, flat round trips, seeded initialisation."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from mpifl.core.errors import ConfigError
from mpifl.models import MODELS, Layer, ParamLayout, build_model


def _d(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "expected_d"),
    [
        ("logreg", (784,), {}, 784 * 10 + 10),
        ("mlp", (784,), {}, 199_210),  # 784-200-200-10
        ("mlp", (784,), {"hidden": (200, 200, 200)}, 199_210 + 200 * 200 + 200),
        # conv 1*32*25+32, conv 32*64*25+64, fc 64*7*7*512+512, out 512*10+10
        ("cnn_mnist", (1, 28, 28), {}, 832 + 51_264 + 1_606_144 + 5_130),
        ("cnn_mnist", (28, 28), {}, 832 + 51_264 + 1_606_144 + 5_130),
        # conv 3*64*25+64, conv 64*64*25+64, fc 64*5*5*384+384, 384*192+192, 192*10+10
        ("cnn_cifar", (3, 32, 32), {}, 4_864 + 102_464 + 614_784 + 73_920 + 1_930),
    ],
)
def test_parameter_counts_and_output_shape(name, shape, kwargs, expected_d):
    model = build_model(name, shape, 10, **kwargs)
    layout = ParamLayout.from_module(model)
    assert layout.d == _d(model) == expected_d
    assert model(torch.zeros(2, *shape)).shape == (2, 10)
    assert not list(model.buffers())


def test_layer_map_tiles_flat_vector_with_weight_and_bias_together():
    model = build_model("mlp", (20,), 3, hidden=(7, 5))
    layout = ParamLayout.from_module(model)
    assert [l.name for l in layout.layers] == ["fc1", "fc2", "out"]
    assert [(l.start, l.stop) for l in layout.layers] == [(0, 147), (147, 187), (187, 205)]
    assert layout.layers[0].slice == slice(0, 147)
    assert layout.d == 205
    cnn = ParamLayout.from_module(build_model("cnn_cifar", (3, 32, 32), 10))
    stops = [0] + [l.stop for l in cnn.layers]
    assert [l.start for l in cnn.layers] == stops[:-1] and stops[-1] == cnn.d
    assert [l.name for l in cnn.layers] == ["conv1", "conv2", "fc1", "fc2", "out"]
    conv1 = dict(build_model("cnn_cifar", (3, 32, 32), 10).named_modules())["conv1"]
    assert cnn.layers[0] == Layer("conv1", 0, conv1.weight.numel() + conv1.bias.numel())


def test_flatten_matches_named_parameters_order():
    model = build_model("mlp", (6,), 4, hidden=(5,))
    layout = ParamLayout.from_module(model)
    flat = layout.flatten_module(model)
    assert flat.dtype == torch.float32 and flat.shape == (layout.d,)
    assert torch.equal(flat, parameters_to_vector(model.parameters()))
    assert layout.offsets == [0, 30, 35, 55]
    assert not flat.requires_grad


def test_flatten_unflatten_round_trip_with_batch_dim():
    layout = ParamLayout.from_module(build_model("cnn_mnist", (1, 12, 12), 3))
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(4, layout.d, generator=g)
    params = layout.unflatten(flat)
    for name, shape in zip(layout.names, layout.shapes):
        assert params[name].shape == (4, *shape)
    assert torch.equal(layout.flatten(params), flat)
    single = layout.unflatten(flat[2])
    assert torch.equal(single["conv1.weight"], params["conv1.weight"][2])
    # Views, not copies: writing through flat shows in the unflattened tensors.
    flat[1, layout.offsets[1]] = 123.0
    assert params[layout.names[1]].reshape(4, -1)[1, 0] == 123.0


def test_layout_errors():
    layout = ParamLayout.from_module(build_model("logreg", (5,), 2))
    with pytest.raises(ValueError):
        layout.unflatten(torch.zeros(layout.d + 1))
    with pytest.raises(ValueError):
        layout.flatten({"fc.weight": torch.zeros(2, 5)})
    with pytest.raises(ValueError):
        layout.flatten({"fc.weight": torch.zeros(2, 4), "fc.bias": torch.zeros(2)})


@pytest.mark.parametrize("name,shape", [("logreg", (8,)), ("mlp", (8,)), ("cnn_mnist", (1, 8, 8)),
                                        ("cnn_cifar", (3, 16, 16))])
def test_softmax_output_is_softmax_of_same_seeded_logits(name, shape):
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0))
    probs = build_model(name, shape, 4, hidden=(6,), output="softmax", seed=3)(x)
    logits = build_model(name, shape, 4, hidden=(6,), output="logits", seed=3)(x)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))


def test_logreg_bias_is_zero():
    model = build_model("logreg", (30,), 3, seed=5)
    assert torch.count_nonzero(model.fc.bias) == 0
    assert torch.count_nonzero(model.fc.weight) > 0


#: A small instance of every built-in model: input shape and factory keywords.
SMALL = {"logreg": ((10,), {}), "mlp": ((10,), {"hidden": (7,)}),
         "cnn_mnist": ((3, 16, 16), {}), "cnn_cifar": ((3, 16, 16), {}),
         "cnn_femnist": ((1, 28, 28), {"hidden": 16}),
         "char_lstm": ((6,), {"vocab_size": 9, "hidden_size": 8}),
         "transformer_lm": ((6,), {"vocab_size": 5, "embedding_size": 8, "hidden_size": 8,
                                   "num_heads": 2, "feedforward_size": 16, "num_layers": 1,
                                   "dropout": 0.0, "sequence_targets": True}),
         "resnet18_gn": ((3, 16, 16), {"width": 8})}


def test_every_built_in_model_has_a_small_instance():
    assert set(SMALL) == set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_seeded_init_is_deterministic_and_leaves_global_rng_alone(name):
    shape, params = SMALL[name]
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    expected_next = torch.rand(3)
    torch.set_rng_state(state)
    a = parameters_to_vector(build_model(name, shape, 5, seed=11, **params).parameters())
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(3), expected_next)
    b = parameters_to_vector(build_model(name, shape, 5, seed=11, **params).parameters())
    c = parameters_to_vector(build_model(name, shape, 5, seed=12, **params).parameters())
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize(
    "args,kwargs",
    [
        (("resnet", (10,), 2), {}),
        (("mlp", (10,), 2), {"output": "probs"}),
        (("mlp", (10,), 0), {}),
        (("mlp", (10,), 2), {"hidden": (0,)}),
        (("cnn_mnist", (784,), 10), {}),
        (("cnn_cifar", (3, 8, 8), 10), {}),
    ],
)
def test_bad_configuration_raises_config_error(args, kwargs):
    with pytest.raises(ConfigError) as info:
        build_model(*args, **kwargs)
    assert "\n" not in str(info.value)
