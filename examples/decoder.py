"""Llama- and GPT-shaped decoders from plain Keras layers, at the sizes people split.

Each size is a zero-argument builder, so the CLI picks one with ``PATH:ATTR``::

    partition examples/decoder.py:llama_7b --gpus 8 --device a100-80gb --topology nvlink \\
        --batch-size 8

The CLI builds the model without its weights (``partitioner.without_weights``): a 7 B model is
planned on a machine that could not hold its 28 GB of float32 weights. In Python::

    with partitioner.without_weights():
        model = decoder.llama_7b()
    plan = partitioner.partition(model, gpus=8, device_type="a100-80gb", batch_size=8)

A block is pre-norm: RMS norm, causal multi-head attention, residual add, RMS norm, a feed-forward
network (SwiGLU for the Llama shapes: ``down(silu(gate(x)) * up(x))``; GELU for the GPT shapes),
residual add. Sizes (blocks x width, heads, FFN, context, vocabulary):

========== ======================== ===== ====== ======= ===== ===========
builder    shape of                 blocks width  FFN    seq   parameters
========== ======================== ===== ====== ======= ===== ===========
gpt_125m   GPT-2 small              12    768    3072    1024  ~163 M (1)
gpt_1_6b   GPT-2 XL                 48    1600   6400    1024  ~1.6 B
llama_7b   Llama 7B                 32    4096   11008   2048  ~6.7 B
llama_13b  Llama 13B                40    5120   13824   2048  ~13 B
========== ======================== ===== ====== ======= ===== ===========

(1) GPT-2 ties its output head to the token embedding (~124 M); here the head is its own
layer, as in Llama, so the GPT shapes carry one more vocabulary x width matrix.

Running this file builds ``gpt_125m`` without weights and shows its summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
from keras import layers


@dataclass(frozen=True)
class DecoderShape:
    """The hyper-parameters of a decoder."""

    name: str
    blocks: int
    width: int
    heads: int
    ffn: int
    seq: int
    vocab: int
    swiglu: bool


SHAPES = {
    "gpt_125m": DecoderShape("gpt_125m", 12, 768, 12, 3072, 1024, 50257, False),
    "gpt_1_6b": DecoderShape("gpt_1_6b", 48, 1600, 25, 6400, 1024, 50257, False),
    "llama_7b": DecoderShape("llama_7b", 32, 4096, 32, 11008, 2048, 32000, True),
    "llama_13b": DecoderShape("llama_13b", 40, 5120, 40, 13824, 2048, 32000, True),
}


def _ffn(x: keras.KerasTensor, shape: DecoderShape, b: int) -> keras.KerasTensor:
    if not shape.swiglu:
        h = layers.Dense(shape.ffn, activation="gelu", name=f"ffn_in_{b}")(x)
        return layers.Dense(shape.width, name=f"ffn_out_{b}")(h)
    gate = layers.Dense(shape.ffn, activation="silu", use_bias=False, name=f"ffn_gate_{b}")(x)
    up = layers.Dense(shape.ffn, use_bias=False, name=f"ffn_up_{b}")(x)
    h = layers.Multiply(name=f"ffn_mul_{b}")([gate, up])
    return layers.Dense(shape.width, use_bias=False, name=f"ffn_down_{b}")(h)


def decoder(shape: DecoderShape) -> keras.Model:
    """The decoder of ``shape``: token ids ``(batch, seq)`` in, next-token logits out."""
    tokens = keras.Input(shape=(shape.seq,), dtype="int32", name="tokens")
    x = layers.Embedding(shape.vocab, shape.width, name="token_embed")(tokens)
    for b in range(shape.blocks):
        h = layers.RMSNormalization(name=f"norm_attn_{b}")(x)
        h = layers.MultiHeadAttention(
            shape.heads, shape.width // shape.heads, use_bias=not shape.swiglu, name=f"attn_{b}"
        )(h, h, use_causal_mask=True)
        x = layers.Add(name=f"add_attn_{b}")([x, h])
        h = layers.RMSNormalization(name=f"norm_ffn_{b}")(x)
        x = layers.Add(name=f"add_ffn_{b}")([x, _ffn(h, shape, b)])
    x = layers.RMSNormalization(name="norm_final")(x)
    logits = layers.Dense(shape.vocab, use_bias=False, name="lm_head")(x)
    return keras.Model(tokens, logits, name=shape.name)


def gpt_125m() -> keras.Model:
    """A GPT-2-small-shaped decoder (~163 M parameters with its own output head)."""
    return decoder(SHAPES["gpt_125m"])


def gpt_1_6b() -> keras.Model:
    """A GPT-2-XL-shaped decoder (~1.6 B parameters)."""
    return decoder(SHAPES["gpt_1_6b"])


def llama_7b() -> keras.Model:
    """A Llama-7B-shaped decoder (~6.7 B parameters)."""
    return decoder(SHAPES["llama_7b"])


def llama_13b() -> keras.Model:
    """A Llama-13B-shaped decoder (~13 B parameters)."""
    return decoder(SHAPES["llama_13b"])


build_model = gpt_125m
"""The default builder the CLI finds: the smallest size."""


if __name__ == "__main__":
    import partitioner

    with partitioner.without_weights():
        model = gpt_125m()
    model.summary()  # ~124 M parameters, none of them allocated
