"""Model zoo and the parameter layout (module -> slice of the flat parameter vector).

Models (ALGORITHMS.md §9), all plain ``nn.Sequential`` stacks without BatchNorm, Dropout or buffers,
so that stacked parameters can be trained with ``torch.func.vmap`` (plugin models may have
BatchNorm and Dropout: :func:`model_traits` tells, and ``client.trainer = "auto"`` trains them with
the per-client loop, :mod:`mpifl.clients.loop`):

- ``logreg``: flatten -> Linear(in, C) with a zero-initialised bias.
- ``mlp``: flatten -> [Linear + ReLU] per hidden size -> Linear(C). Two hidden layers of 200 is the
  FedFV CIFAR-10/FMNIST model; three of 200 the FedLF FMNIST one; four the mFairFL tabular one.
- ``cnn_mnist``: the FedAvg/FedFV MNIST CNN (McMahan et al., AISTATS 2017; Wang et al., IJCAI 2021,
  as in the FedFV authors' easyFL code): Conv(32, 5x5, pad 2) ReLU MaxPool2 -> Conv(64, 5x5, pad 2)
  ReLU MaxPool2 -> FC 512 ReLU -> FC C.
- ``cnn_cifar``: the FedLF CIFAR-10 CNN (Pan et al., AAAI 2024): Conv(64, 5x5) ReLU MaxPool2 ->
  Conv(64, 5x5) ReLU MaxPool2 -> FC 384 ReLU -> FC 192 ReLU -> FC C.

``output="softmax"`` appends ``Softmax(dim=-1)``: the FedFV reference code trains
``CrossEntropyLoss`` on those probabilities (a "double softmax", ALGORITHMS.md §9 "Reference-code
models"). mpifl always trains and evaluates with ``F.cross_entropy(model(x), y)``, so such a
model gets exactly that double softmax.

The flat parameter vector ``w`` (dimension ``d``) is the concatenation of the parameters in
``model.named_parameters()`` order (ALGORITHMS.md §0); :class:`ParamLayout` maps names and layers to
slices of it.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from mpifl.core.blame import blame
from mpifl.core.errors import ConfigError, MpiflError
from mpifl.core.layout import ParamLayout, buffer_names
from mpifl.core.registry import Registry, closest

OUTPUTS = ("logits", "softmax")


def _check_factory(name: str, factory: object) -> None:
    if not callable(factory):
        raise TypeError(f"model {name!r} must be a callable factory "
                        f"(input_shape, num_classes, *, seed, **params) -> nn.Module")


#: Model factories by name: ``factory(input_shape, num_classes, *, seed, **params) -> nn.Module``
#: (built-ins below; plugins add theirs with ``@MODEL_FACTORIES.register("name")``).
MODEL_FACTORIES: Registry[Callable[..., nn.Module]] = Registry("model", _check_factory)

#: ``register_model(size=)``'s default: the budget builds the factory on torch's meta device
META = "meta"

#: a registered model factory: :func:`register_model` returns it unchanged
F = TypeVar("F", bound=Callable[..., nn.Module])


def register_model(name: str, *, size: Callable[..., int] | str = META) -> Callable[[F], F]:
    """Decorator: register a model factory as ``model.name = "<name>"`` and say how the memory
    budget (:mod:`mpifl.experiment.budget`) counts its parameters before anything is built.

    Args:
        size: :data:`META` (the default): the factory is built on torch's ``meta`` device,
            which holds shapes only, so it must do nothing but build torch modules (no file
            read, no other library's allocation); otherwise ``size(input_shape, num_classes,
            **params) -> d`` computes its parameter count. A factory registered with
            ``MODEL_FACTORIES.register`` alone is never run before the real build, and the
            budget counts no model for it.

    Raises:
        ValueError: the name is taken by another factory, empty, or contains ':'.
    """
    if size != META and not callable(size):
        raise TypeError(f"model {name!r}: size= must be {META!r} or a function, got {size!r}")

    def deco(factory: F) -> F:
        # the factory carries how to count it, read back by parameter_count
        setattr(factory, "size", size)  # noqa: B010 -- mypy refuses `factory.size =`
        MODEL_FACTORIES.register(name)(factory)
        return factory

    return deco


def parameter_count(name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int,
                    params: dict[str, Any]) -> tuple[int, int] | None:
    """(d, layers): the parameters and float buffers of model ``name`` for this input, and its
    parameter tensors, as its registration says to count them (:func:`register_model`), without
    allocating them; None for a factory registered without a ``size`` or one that fails here
    (the real build names the problem)."""
    try:
        factory = MODEL_FACTORIES.get(name)
    except (LookupError, TypeError, ValueError):
        return None
    how = getattr(factory, "size", None)
    try:
        if callable(how):
            return int(how(input_shape, num_classes, **params)), 1
        if how != META:
            return None
        with torch.device("meta"):
            model = factory(input_shape, num_classes, seed=seed, **params)
        named = list(model.named_parameters())
        d = sum(p.numel() for _, p in named)
        d += sum(b.numel() for b in model.buffers() if b.is_floating_point())
    except Exception:  # noqa: BLE001 -- the real build names the problem
        return None
    return int(d), max(1, len(named))


# --------------------------------------------------------------------------- model zoo


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    output: str = "logits",
    seed: int = 0,
    vocab_size: int | None = None,
    sample: torch.Tensor | None = None,
    sequence_targets: bool = False,
    dataset: str | None = None,
    **params: Any,
) -> nn.Module:
    """Build a registered model (built-in or plugin) with deterministic initial weights.

    Args:
        name: a name of :data:`MODEL_FACTORIES` (built-ins: :data:`mpifl.models.MODELS`) or an
            import path
            ``"pkg.module:factory"``.
        input_shape: shape of one sample, without the batch dimension, e.g. ``(784,)``,
            ``(1, 28, 28)`` or ``(3, 32, 32)``. CNNs take ``(C, H, W)`` or ``(H, W)`` (one channel).
        num_classes: output width: the number of classes C, of regression targets, or 1 for
            a one-logit loss (``bce``); the model outputs ``(batch, num_classes)``.
        output: ``"logits"`` or ``"softmax"`` (appends ``Softmax(dim=-1)``, FedFV reference code).
        seed: initial weights depend only on this; the global torch RNG is left untouched.
        vocab_size: V for token inputs (``input_shape = (T,)`` int64 ids), passed to a factory
            whose signature names ``vocab_size`` (unless ``params`` sets it). A factory that
            does not name it is built without it and judged by what it does on ``sample``
            (e.g. a model sizing its embedding from ``num_classes`` is accepted; one whose
            first layer is a ``Linear`` fails on int64 ids and is refused).
        sample: (b, *input_shape) a real batch of the run's data (b >= 2), on which the model
            is checked in eval and train mode (a run always passes one); None: two zero
            samples, padding ids for token inputs.
        sequence_targets: the targets are (T,) tokens a sample: the output must be
            ``(b, T, num_classes)``.
        dataset: ``data.dataset``, named in the refusals (None: "the data set").
        params: keyword arguments of the factory: a plugin model's ``[model.params]``, or
            ``hidden`` (layer widths) of the built-in ``mlp`` (:func:`model_params`).

    Returns:
        An ``nn.Module`` of float32 CPU parameters (checked: :func:`check_model`), in eval
        mode: evaluation uses it as it is; trainers put their own copies in train mode.

    Raises:
        ConfigError: unknown name or output, shapes the model cannot take, parameters the
            factory refuses, a token model (one that needs ``vocab_size``) on float features,
            a model that fails on token ids, or a model that breaks the vmap contract.
    """
    try:
        factory = MODEL_FACTORIES.get(name)
    except LookupError as exc:
        raise ConfigError(f"model.name: {exc}") from None
    if output not in OUTPUTS:
        raise ConfigError(f"unknown model output {output!r}; choose 'logits' or 'softmax'")
    shape = _check_shape(input_shape)
    if int(num_classes) < 1:
        raise ConfigError(f"the model's output width must be at least 1, got {num_classes}")
    params = _with_vocab(name, factory, vocab_size, params, dataset)
    if sample is None and (vocab_size is not None or "vocab_size" in params):
        sample = torch.zeros(2, *shape, dtype=torch.int64)
    _check_params(name, factory, params)
    # Module constructors draw from the global CPU generator: fork it so that the caller's
    # random stream is exactly as before, and seed only the forked copy.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(int(seed))
        with blame([("model", name, factory)], "build"):
            try:
                model = factory(shape, int(num_classes), seed=int(seed), **params)
            except TypeError as exc:  # most often a [model.params] key the factory lacks
                raise ConfigError(f"model '{name}': {exc}") from None
    if output == "softmax":
        model = nn.Sequential(OrderedDict([*model.named_children()], softmax=nn.Softmax(dim=-1))) \
            if isinstance(model, nn.Sequential) else nn.Sequential(model, nn.Softmax(dim=-1))
    with blame([("model", name, factory)], "check"):
        check_model(model, shape, int(num_classes), name, sample=sample,
                    sequence_targets=sequence_targets, dataset=dataset,
                    vocab_size=params.get("vocab_size"))
    return model.eval()


def model_params(name: str, hidden: Sequence[int], params: dict[str, Any]) -> dict[str, Any]:
    """The factory keywords of a config's ``[model]``: ``model.hidden`` goes to the built-in
    ``mlp`` only (the other built-ins have no hidden layers to size); any other model, a
    plugin's above all, gets exactly its own ``[model.params]``, no built-in default."""
    return {"hidden": tuple(hidden), **params} if name == "mlp" else dict(params)


#: build_model's own keywords, which a ``[model.params]`` key would collide with, and where
#: their values come from (:func:`factory_keywords`)
RESERVED = {"name": "model.name", "input_shape": "the data set", "num_classes": "the data set",
            "output": "model.output", "seed": "run.seed", "sample": "the data set",
            "sequence_targets": "the data set", "dataset": "data.dataset"}


def factory_keywords(name: str, params: Mapping[str, Any], vocab_size: int | None,
                     dataset: str) -> tuple[dict[str, Any], int | None]:
    """A config's ``[model.params]`` for :func:`build_model`, never colliding with what mpifl
    passes itself: ``(params, vocab_size)``, the factory keywords and the vocabulary to hand
    the factory.

    ``vocab_size`` is mpifl's (the data set's V) when the data set holds token ids: a user's
    equal ``model.params.vocab_size`` is let through (dropped: the same value is passed), a
    different one refused. On float features it is an ordinary factory keyword (e.g. a
    bag-of-words model's width), passed when the factory names it.

    Raises:
        ConfigError: a key mpifl sets itself (``seed``: run.seed, ...), a ``vocab_size``
            other than the data set's, or a ``vocab_size`` the factory does not take.
    """
    params = dict(params)
    for key, source in RESERVED.items():
        if key in params:
            raise ConfigError(f"model.params.{key}: mpifl passes '{key}' to model '{name}' "
                              f"itself (from {source}); remove the key")
    if "vocab_size" not in params:
        return params, vocab_size
    mine = params.pop("vocab_size")
    if vocab_size is not None:
        if mine != vocab_size:
            raise ConfigError(f"model.params.vocab_size = {mine!r}: data set '{dataset}' holds "
                              f"token ids 0..{vocab_size - 1}, and mpifl passes its vocab_size "
                              f"{vocab_size} to model '{name}' itself; remove the key")
        return params, vocab_size
    taken: Mapping[str, inspect.Parameter]
    try:
        taken = inspect.signature(MODEL_FACTORIES.get(name)).parameters
    except LookupError as exc:
        raise ConfigError(f"model.name: {exc}") from None
    except (TypeError, ValueError):  # no signature: it cannot be told that it takes one
        taken = {}
    if "vocab_size" not in taken:  # build_model hands vocab_size only to a factory naming it
        raise ConfigError(f"unknown key 'model.params.vocab_size': model '{name}' takes no "
                          f"parameter 'vocab_size', and data set '{dataset}' holds float "
                          f"features, no token ids")
    if not isinstance(mine, int) or isinstance(mine, bool):
        raise ConfigError(f"model.params.vocab_size: an integer, got {mine!r}")
    return params, mine


def _with_vocab(name: str, factory: Callable[..., nn.Module], vocab_size: int | None,
                params: dict[str, Any], dataset: str | None) -> dict[str, Any]:
    """``params`` plus ``vocab_size`` for a factory that names it (token inputs); a factory
    that needs it (no default) refused on a data set without a vocabulary."""
    taken: Mapping[str, inspect.Parameter]
    try:
        taken = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        taken = {}
    if vocab_size is not None and "vocab_size" not in params and "vocab_size" in taken:
        params = {**params, "vocab_size": int(vocab_size)}
    need = taken.get("vocab_size")
    if vocab_size is None and "vocab_size" not in params and need is not None \
            and need.default is need.empty:
        where = f"data set '{dataset}'" if dataset else "the data set"
        raise ConfigError(f"model '{name}' embeds token ids (its factory needs vocab_size), "
                          f"but {where} holds float features, not token ids: choose a model "
                          f"for float inputs (e.g. mlp, cnn_mnist) or a data set of token ids")
    return params


def _check_params(name: str, factory: Callable[..., nn.Module], params: dict[str, Any]) -> None:
    """Each ``[model.params]`` key a keyword of the factory (unless it takes ``**kwargs``), so a
    mistyped key is named with the closest one instead of ignored or raised from inside."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a callable without a signature: its own call decides
        return
    taken = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in taken):
        return
    known = [p.name for p in list(taken)[2:]  # after (input_shape, num_classes)
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "seed"]
    for key in params:
        if key not in known:
            close = closest(key, known)
            hint = f" (did you mean 'model.params.{close}'?)" if close else ""
            raise ConfigError(f"unknown key 'model.params.{key}'{hint}: model '{name}' takes "
                              f"no parameter '{key}' (its parameters: "
                              f"{', '.join(known) or 'none'})")


def check_model(model: object, input_shape: tuple[int, ...], num_classes: int,
                name: str = "model", *, sample: torch.Tensor | None = None,
                sequence_targets: bool = False, dataset: str | None = None,
                vocab_size: int | None = None) -> None:
    """The contract of every trainer: an ``nn.Module`` with at least one parameter, all float32;
    float32 buffers only (BatchNorm's running statistics travel in w with the parameters); no
    BatchNorm without running statistics (it would evaluate each client's test set with that
    set's own batch statistics); output ``(b, num_classes)`` (``(b, T, num_classes)`` for
    sequence targets) on ``sample`` in eval mode and in train mode. Buffers and random layers
    (Dropout, ``F.dropout``) are allowed; :func:`model_traits` reports them.

    Args:
        sample: (b, *input_shape) a real batch of the run's data, b >= 2 (token ids for a
            language model: random floats or zeros would not be the inputs it trains on);
            None: two zero samples of float features.
        sequence_targets: expect one row of num_classes logits at each of the T positions.
        dataset: ``data.dataset``, named in the refusals. vocab_size: the vocabulary the
            factory was given (None: it was given none), for the message of a model that
            fails on token ids.

    Raises:
        ConfigError: naming the model, the offending parameter, buffer or module, and why;
            a model whose forward fails on integer token ids (a plugin's failure on float
            features is named by :func:`mpifl.core.blame.blame`).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model '{name}': the factory must return a torch.nn.Module, "
                          f"got {type(model).__name__}")
    named = list(model.named_parameters())
    if not named:
        raise ConfigError(f"model '{name}' has no parameters to train")
    for pname, p in named:
        if p.dtype != torch.float32:
            raise ConfigError(f"model '{name}': parameter '{pname}' is {p.dtype}; mpifl trains "
                              f"float32 parameters (build it with dtype=torch.float32)")
    for bname, buf in model.named_buffers():
        if buf.is_floating_point() and buf.dtype != torch.float32:
            raise ConfigError(f"model '{name}': buffer '{bname}' is {buf.dtype}; mpifl keeps "
                              f"float32 state")
    for mname, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and not module.track_running_stats:
            raise ConfigError(f"model '{name}': '{mname}' is BatchNorm without running "
                              f"statistics, which would evaluate every client's test set with "
                              f"that set's own batch statistics; keep track_running_stats=True "
                              f"(the statistics then travel with the model, ALGORITHMS.md §9)")
    x = torch.zeros(2, *input_shape) if sample is None else sample
    b = int(x.shape[0])
    want = (b, *(tuple(input_shape) if sequence_targets else ()), num_classes)
    for mode in ("eval", "train"):
        try:
            out = _forward_unchanged(model, x, train=mode == "train")
        except MpiflError:
            raise
        except Exception as exc:
            if x.is_floating_point():
                raise
            raise ConfigError(_token_failure(name, x, exc, dataset, vocab_size)) from None
        if tuple(out.shape) != want:
            raise ConfigError(f"model '{name}': output shape {tuple(out.shape)} for a batch of "
                              f"{b} in {mode} mode, expected {want}")


def _token_failure(name: str, x: torch.Tensor, exc: Exception, dataset: str | None,
                   vocab_size: int | None) -> str:
    """One line: a model whose forward fails on the run's token ids, and why."""
    where = f"data set '{dataset}'" if dataset else "the data set"
    first = (str(exc).strip().splitlines() or [""])[0]
    why = f"on the run's samples ({tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}) " \
          f"it fails: {type(exc).__name__}: {first}"
    if vocab_size is None:
        return (f"model '{name}' takes float features, but {where} holds token ids: {why}; "
                f"choose a model that embeds token ids (char_lstm, transformer_lm, or a "
                f"factory whose model embeds them)")
    return f"model '{name}' cannot take {where}'s token ids (vocab_size {vocab_size}): {why}"


def model_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's eval-mode output on x without gradients, leaving its mode, buffers and the
    caller's random streams as they were (what the loss is checked on at set-up)."""
    return _forward_unchanged(model, x, train=False)


def _forward_unchanged(model: nn.Module, x: torch.Tensor, *, train: bool) -> torch.Tensor:
    """The model's output on x in train or eval mode, leaving its mode, buffers and the
    caller's random streams as they were."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train(train)
            return model(x.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])


@dataclass(frozen=True)
class ModelTraits:
    """What a model needs of its trainer (:func:`model_traits`).

    Attributes:
        buffers: names of the float buffers in w (e.g. ``"bn1.running_mean"``); vmapped
            training cannot update them, the per-client loop can.
        random: the forward pass in train mode draws random numbers (``nn.Dropout``,
            ``F.dropout``, ...); vmapped training would take them from one shared stream,
            the per-client loop keys them by (seed, round, client, step).
        convolutional: the model has convolutions (``client.trainer = "auto"`` may prefer the
            loop for them, see :func:`mpifl.clients.select_trainer`).
        unbatched: the operators of its training step that ``torch.func.vmap`` has no batching
            rule for (e.g. ``aten::mkldnn_rnn_layer`` of ``nn.LSTM`` on a CPU): vmap still
            trains such a model exactly, but runs those operators one client at a time, so
            ``auto`` prefers the loop.
    """

    buffers: tuple[str, ...] = ()
    random: bool = False
    convolutional: bool = False
    unbatched: tuple[str, ...] = ()

    @property
    def vmappable(self) -> bool:
        """Whether the vectorised trainers can train this model exactly."""
        return not self.buffers and not self.random


def model_traits(model: nn.Module, input_shape: Sequence[int],
                 sample: torch.Tensor | None = None) -> ModelTraits:
    """Detect buffers, randomness, convolutions and unbatched operators of a checked model,
    once, when the run is assembled (never in round 1).

    Randomness is found by running the model in train mode on one batch under two different
    torch seeds: any layer drawing random numbers, a module or a functional call
    (``F.dropout`` inside ``forward``), gives different outputs. Unbatched operators are
    those for which one vmapped gradient over two copies of the parameters warns that it
    falls back to a loop. The caller's random streams and the model's mode and buffers are
    left as they were.

    Args:
        sample: (b, *input_shape) a batch of the run's data (token ids for a language model);
            None: four random float samples.
    """
    shape = _check_shape(input_shape)
    buffers = tuple(buffer_names(model))
    device = next(model.parameters()).device
    if sample is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            sample = torch.randn(4, *shape, device=device)
    outs = []
    for seed in (1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            outs.append(_forward_unchanged(model, sample, train=True))
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    unbatched = () if buffers else _unbatched_ops(model, sample[:2].to(device))
    return ModelTraits(buffers, not torch.equal(outs[0], outs[1]), conv, unbatched)


_FALLBACK = re.compile(r"batching rule for (\S+?)\.? ")


def _unbatched_ops(model: nn.Module, x: torch.Tensor) -> tuple[str, ...]:
    """The operators of one vmapped gradient step (two parameter copies, eval mode so that
    random layers draw nothing) that vmap runs through its slow per-sample fallback."""
    from torch.func import functional_call, grad, vmap
    params = {n: p.detach().unsqueeze(0).expand(2, *p.shape) for n, p in model.named_parameters()}
    xs = x.unsqueeze(0).expand(2, *x.shape)

    def total(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xb,)).float().sum()

    was_training = model.training
    try:
        model.eval()
        with warnings.catch_warnings(record=True) as caught, torch.random.fork_rng(devices=[]):
            warnings.simplefilter("always")
            vmap(grad(total))(params, xs)
    finally:
        model.train(was_training)
    found = (_FALLBACK.search(str(w.message)) for w in caught)
    return tuple(sorted({m.group(1) for m in found if m}))


#: ``model.batchnorm``: where BatchNorm's state lives (ALGORITHMS.md §9, "BatchNorm").
BATCHNORM_MODES = ("global", "local", "local_stats")


def batchnorm_coordinates(model: nn.Module, layout: ParamLayout, mode: str) -> np.ndarray:
    """Positions in w of the BatchNorm coordinates that stay with each client.

    Args:
        model: the checked model. layout: its :class:`~mpifl.core.layout.ParamLayout`.
        mode: ``"global"`` (none: statistics and affine parameters are aggregated like every
            other coordinate), ``"local"`` (FedBN, Li et al., ICLR 2021: every BatchNorm
            layer's running statistics and affine weight and bias), ``"local_stats"`` (the
            running statistics only, as SiloBN, Andreux et al., MICCAI DART 2020).

    Returns:
        (s,) int64 ascending positions into w (empty for ``"global"``).

    Raises:
        ConfigError: an unknown mode, or a local mode for a model without BatchNorm (the
            setting would do nothing).
    """
    if mode not in BATCHNORM_MODES:
        raise ConfigError(f"model.batchnorm: unknown mode {mode!r}; choose "
                          f"{', '.join(BATCHNORM_MODES)}")
    names: set[str] = set()
    if mode != "global":
        norms = [(prefix, module) for prefix, module in model.named_modules()
                 if isinstance(module, nn.modules.batchnorm._NormBase)]
        if not norms:
            raise ConfigError(f"model.batchnorm = {mode!r}: the model has no BatchNorm layers, "
                              f"so there is nothing to keep per client; remove the setting "
                              f"(or set model.batchnorm = \"global\")")
        for prefix, _ in norms:
            kinds = ("running_mean", "running_var") + (("weight", "bias") if mode == "local"
                                                       else ())
            names.update(f"{prefix}.{k}" if prefix else k for k in kinds)
    pos = [np.arange(off, off + n) for name, off, n in
           zip(layout.names, layout.offsets, layout.numels) if name in names]
    return np.concatenate(pos).astype(np.int64) if pos else np.zeros(0, dtype=np.int64)


def _check_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ConfigError(f"input_shape must be non-empty and positive, got {tuple(input_shape)}")
    return shape


@register_model("logreg")
def _logreg(shape: tuple[int, ...], c: int, *, seed: int = 0, hidden: object = None) -> nn.Sequential:
    fc = nn.Linear(math.prod(shape), c)
    nn.init.zeros_(fc.bias)  # as in the reference logistic regressions (ALGORITHMS.md §8)
    return nn.Sequential(OrderedDict(flatten=nn.Flatten(), fc=fc))


@register_model("mlp")
def _mlp(shape: tuple[int, ...], c: int, *, seed: int = 0, hidden: Sequence[int] = (200, 200)) -> nn.Sequential:
    if any(int(h) < 1 for h in hidden):
        raise ConfigError(f"mlp hidden sizes must be positive, got {hidden}")
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    width = math.prod(shape)
    for i, h in enumerate(hidden, start=1):
        layers[f"fc{i}"] = nn.Linear(width, int(h))
        layers[f"relu{i}"] = nn.ReLU()
        width = int(h)
    layers["out"] = nn.Linear(width, c)
    return nn.Sequential(layers)


def _image_input(shape: tuple[int, ...],
                 model: str) -> tuple[OrderedDict[str, nn.Module], int, int, int]:
    """Leading layers that turn a ``(batch, *shape)`` input into ``(batch, C, H, W)``."""
    if len(shape) == 2:
        # (batch, H, W) -> (batch, 1, H, W): split dim 1 (size H) into (1, H).
        return OrderedDict(unsqueeze=nn.Unflatten(1, (1, shape[0]))), 1, shape[0], shape[1]
    if len(shape) == 3:
        return OrderedDict(), *shape
    raise ConfigError(f"{model} needs input_shape (C, H, W) or (H, W), got {shape}")


@register_model("cnn_mnist")
def _cnn_mnist(shape: tuple[int, ...], c: int, *, seed: int = 0, hidden: object = None) -> nn.Sequential:
    layers, ch, h, w = _image_input(shape, "cnn_mnist")
    if h < 4 or w < 4:
        raise ConfigError(f"cnn_mnist needs images of at least 4x4, got {h}x{w}")
    layers.update(
        conv1=nn.Conv2d(ch, 32, 5, padding=2), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(32, 64, 5, padding=2), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(64 * (h // 2 // 2) * (w // 2 // 2), 512), relu3=nn.ReLU(),
        out=nn.Linear(512, c),
    )
    return nn.Sequential(layers)


@register_model("cnn_cifar")
def _cnn_cifar(shape: tuple[int, ...], c: int, *, seed: int = 0, hidden: object = None) -> nn.Sequential:
    layers, ch, h, w = _image_input(shape, "cnn_cifar")
    # Two unpadded 5x5 convolutions, each followed by a 2x2 max-pool: 32 -> 28 -> 14 -> 10 -> 5.
    fh, fw = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    if fh < 1 or fw < 1:
        raise ConfigError(f"cnn_cifar needs images of at least 16x16, got {h}x{w}")
    layers.update(
        conv1=nn.Conv2d(ch, 64, 5), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(64, 64, 5), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(64 * fh * fw, 384), relu3=nn.ReLU(),
        fc2=nn.Linear(384, 192), relu4=nn.ReLU(),
        out=nn.Linear(192, c),
    )
    return nn.Sequential(layers)
