"""``char_lstm``: LEAF's Shakespeare next-character LSTM.

Caldas et al., "LEAF: A Benchmark for Federated Settings" (2018), TalwalkarLab/leaf
``models/shakespeare/stacked_lstm.py`` (also FLUTE's Shakespeare model, microsoft/msrflute):
Embedding(V, 8) -> 2-layer LSTM of 256 units -> Dense(C). LEAF predicts the character that
follows an 80-character window from the LSTM's last output (``sequence=False``); TensorFlow
Federated's Shakespeare task predicts the next character at every position (``sequence=True``,
targets (b, T) with the padding id 0 skipped by ``token_cross_entropy``).

Initial weights are PyTorch's defaults for ``nn.Embedding``, ``nn.LSTM`` and ``nn.Linear``
(LEAF's TensorFlow cells initialise differently). ``torch.func.vmap`` trains the model exactly,
but on a CPU it has no batching rule for the LSTM kernel (``aten::mkldnn_rnn_layer``) and runs
it one client at a time (:func:`mpifl.models.zoo.model_traits` reports it as ``unbatched``).
"""

from __future__ import annotations

from torch import Tensor, nn

from mpifl.core.errors import ConfigError
from mpifl.models.zoo import register_model

__all__ = ["CharLSTM", "char_lstm"]


class CharLSTM(nn.Module):
    """Embedding -> stacked LSTM -> Linear, on (b, T) int64 token ids.

    Output: (b, C) logits from the last position, or (b, T, C) with ``sequence``.
    """

    def __init__(self, vocab_size: int, num_classes: int, embedding_dim: int,
                 hidden_size: int, num_layers: int, sequence: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers, batch_first=True)
        self.out = nn.Linear(hidden_size, num_classes)
        self.sequence = bool(sequence)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h if self.sequence else h[:, -1])


@register_model("char_lstm")
def char_lstm(input_shape: tuple[int, ...], num_classes: int, *, seed: int = 0,
              vocab_size: int, embedding_dim: int = 8, hidden_size: int = 256,
              num_layers: int = 2, sequence: bool = False) -> CharLSTM:
    """LEAF's Shakespeare LSTM (Caldas et al., 2018).

    Args:
        input_shape: (T,) token ids a sample (LEAF: T = 80).
        num_classes: C, the characters predicted over. seed: unused (mpifl seeds torch).
        vocab_size: V, ids 0..V-1 (0 is padding); passed by the data set.
        embedding_dim, hidden_size, num_layers: LEAF's 8, 256 and 2.
        sequence: predict at every position ((b, T, C), TFF's Shakespeare) instead of after
            the last one ((b, C), LEAF).

    Raises:
        ConfigError: input_shape not (T,), or sizes below 1 (vocab_size below 2).
    """
    sizes = dict(embedding_dim=embedding_dim, hidden_size=hidden_size, num_layers=num_layers)
    if len(tuple(input_shape)) != 1 or int(vocab_size) < 2 or min(map(int, sizes.values())) < 1:
        raise ConfigError(f"char_lstm needs input_shape (T,) of token ids, vocab_size >= 2 and "
                          f"positive sizes, got {tuple(input_shape)}, vocab_size {vocab_size}, "
                          f"{sizes}")
    return CharLSTM(int(vocab_size), int(num_classes), int(embedding_dim), int(hidden_size),
                    int(num_layers), bool(sequence))
