"""``transformer_lm``: the small next-word transformer of pfl-research's StackOverflow benchmark.

Granqvist et al., "pfl-research: simulation framework for accelerating research in Private
Federated Learning" (2024), apple/pfl-research ``benchmarks/model/pytorch/transformer.py``
(``lm_transformer``) with the sizes of ``benchmarks/lm/configs/baseline.yaml``: embedding 96,
hidden 96, 8 heads, feed-forward 1536, 3 encoder layers, dropout 0.1; the vocabulary is
StackOverflow's 10,000 words plus specials and sequences are 20 tokens. pfl-research takes the
model from google-research/federated ``fedopt_guide/stackoverflow_transformer`` (Wang et al.,
"A Field Guide to Federated Optimization", 2021).

As there: token embedding (padding id 0) scaled by sqrt(embedding), plus the sinusoidal
positional encoding of Vaswani et al. (2017, §3.5); a linear projection to the hidden size when
it differs; post-norm ``nn.TransformerEncoderLayer`` (ReLU) with a causal mask, so position t
sees positions <= t only; projection back; logits tied to the embedding (``x @ E.T``).
Initialisation as there: embedding uniform(-0.05, 0.05), projections Xavier-uniform with zero
bias, encoder layers PyTorch's defaults.

Differences, both without effect on the function computed: the positional encoding is computed
in ``forward`` instead of stored as a buffer (mpifl's vectorised trainers take models without
buffers), and the encoder is built with ``enable_nested_tensor=False``.

With ``dropout > 0`` (pfl-research's 0.1) the model draws random numbers in training, so mpifl
trains it with the per-client loop (keyed dropout masks); ``dropout = 0`` makes it a
deterministic function that ``torch.func.vmap`` trains exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mpifl.core.errors import ConfigError
from mpifl.models.zoo import register_model

__all__ = ["TransformerLM", "positional_encoding", "transformer_lm"]


def positional_encoding(length: int, depth: int, device: torch.device | None = None) -> Tensor:
    """(length, depth) float32 sinusoidal encoding (Vaswani et al., 2017, §3.5): sin on even
    columns, cos on odd ones, of position / 10000^(2i/depth)."""
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    div = torch.exp(torch.arange(0, depth, 2, dtype=torch.float32, device=device)
                    * (-math.log(10000.0) / depth))
    pe = torch.zeros(length, depth, device=device)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div[: depth // 2])
    return pe


class TransformerLM(nn.Module):
    """Causal transformer language model on (b, T) int64 ids; output (b, T, C) logits."""

    def __init__(self, vocab_size: int, num_classes: int, embedding_size: int, hidden_size: int,
                 num_heads: int, feedforward_size: int, num_layers: int, dropout: float,
                 tie_embeddings: bool):
        super().__init__()
        self.scale = math.sqrt(embedding_size)
        self.embed = nn.Embedding(vocab_size, embedding_size, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.05, 0.05)  # pfl-research's init (pad row too)
        same = embedding_size == hidden_size
        self.proj_in = nn.Identity() if same else nn.Linear(embedding_size, hidden_size)
        self.proj_out = nn.Identity() if same else nn.Linear(hidden_size, embedding_size)
        for proj in (self.proj_in, self.proj_out):
            if isinstance(proj, nn.Linear):
                nn.init.xavier_uniform_(proj.weight)
                nn.init.zeros_(proj.bias)
        layer = nn.TransformerEncoderLayer(hidden_size, num_heads, feedforward_size, dropout,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.out = None if tie_embeddings else nn.Linear(embedding_size, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[-1]
        # True above the diagonal: position t does not attend to later positions
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.embed(x) * self.scale + positional_encoding(t, self.embed.embedding_dim,
                                                             x.device)
        h = self.proj_out(self.encoder(self.proj_in(h), mask=causal))
        return h @ self.embed.weight.t() if self.out is None else self.out(h)


@register_model("transformer_lm")
def transformer_lm(input_shape: tuple[int, ...], num_classes: int, *, seed: int = 0,
                   vocab_size: int, embedding_size: int = 96, hidden_size: int = 96,
                   num_heads: int = 8, feedforward_size: int = 1536, num_layers: int = 3,
                   dropout: float = 0.1, tie_embeddings: bool = True) -> TransformerLM:
    """pfl-research's StackOverflow transformer (defaults: its baseline sizes).

    Args:
        input_shape: (T,) token ids a sample (pfl-research: T = 20).
        num_classes: C, the vocabulary predicted over; equal to ``vocab_size`` with tied
            embeddings. seed: unused (mpifl seeds torch before calling).
        vocab_size: V, ids 0..V-1 with 0 the padding id; passed by the data set.
        embedding_size, hidden_size, num_heads, feedforward_size, num_layers: the sizes;
            hidden_size must be divisible by num_heads.
        dropout: dropout rate of the encoder layers (pfl-research: 0.1; 0 for vmap).
        tie_embeddings: output logits through the input embedding (pfl-research); False: an
            own output layer, for C != V.

    Returns:
        :class:`TransformerLM`: (b, T) int64 -> (b, T, C) float32 logits; no buffers.

    Raises:
        ConfigError: input_shape not (T,), non-positive sizes, hidden_size not divisible by
            num_heads, dropout outside [0, 1), or tied embeddings with C != V.
    """
    sizes = dict(embedding_size=embedding_size, hidden_size=hidden_size, num_heads=num_heads,
                 feedforward_size=feedforward_size, num_layers=num_layers)
    if len(tuple(input_shape)) != 1 or int(vocab_size) < 2 or min(map(int, sizes.values())) < 1:
        raise ConfigError(f"transformer_lm needs input_shape (T,) of token ids, vocab_size >= 2 "
                          f"and positive sizes, got {tuple(input_shape)}, vocab_size "
                          f"{vocab_size}, {sizes}")
    if int(hidden_size) % int(num_heads) or not 0.0 <= float(dropout) < 1.0:
        raise ConfigError(f"transformer_lm: hidden_size {hidden_size} must be divisible by "
                          f"num_heads {num_heads}, and dropout {dropout} lie in [0, 1)")
    if tie_embeddings and int(num_classes) != int(vocab_size):
        raise ConfigError(f"transformer_lm ties its output to the input embedding, so it "
                          f"predicts over the vocabulary ({vocab_size}), not {num_classes} "
                          f"classes; set model.params.tie_embeddings = false")
    return TransformerLM(int(vocab_size), int(num_classes), int(embedding_size),
                         int(hidden_size), int(num_heads), int(feedforward_size),
                         int(num_layers), float(dropout), bool(tie_embeddings))
