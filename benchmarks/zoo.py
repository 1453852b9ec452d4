"""The benchmark zoo: Keras models built from Keras's own layers and ``keras.applications``.

Every model has random weights (``weights=None``); nothing is downloaded. Each entry says the
batch size it is traced at and the device type of the catalog it is planned for:

* ``resnet50``, ``inception_v3`` (branchy), ``mobilenet_v2``, ``densenet121``:
  ``keras.applications`` at their ImageNet input sizes, batch 32, H100.
* ``bert_base``: a BERT-base-sized Transformer encoder (12 post-LN blocks, d_model 768, 12 heads,
  FFN 3072, sequence 128, vocabulary 30522, token + position embeddings; 132 M parameters, the
  110 M of BERT-base plus an untied 23 M LM head), batch 32, H100.
* ``gpt2_small``: a GPT-2-small-sized decoder (12 pre-LN causal blocks, d_model 768, 12 heads,
  FFN 3072, context 1024, vocabulary 50257, untied LM head; 163 M parameters), batch 8, H100.
* ``lstm_nmt``: an LSTM encoder-decoder with attention, like the NMT models of the device-placement
  papers (Mirhoseini et al., ICML 2017; Addanki et al., "Placeto", NeurIPS 2019): 4 encoder and
  4 decoder LSTM(1024) layers, Luong (dot) attention, vocabulary 32000, 40 tokens per side,
  batch 64, H100.
* ``multi_tower``: a wide multi-tower MLP (8 towers of 3 x Dense(4096) on one 2048-wide input,
  concatenated, then a 1000-way head), batch 256, H100: branches a good placement runs at once.
* ``transformer_1b``: a GPT-style decoder of about 1.1 B parameters (20 pre-LN causal blocks,
  d_model 2048, 16 heads, FFN 8192, context 512, vocabulary 32000), batch 8, planned on
  ``v100-16gb``: with Adam its weights, gradients and optimizer state alone (16 bytes per
  parameter, 18.2 GB) exceed one 16 GB device, so ``single`` is infeasible and a split is required
  (with the saved activations of batch 8 it needs 48 GiB: at least 4 devices). It is traced in
  full, every block real: building it allocates its 4.6 GB of float32 weights (about 8 GB peak
  resident memory for the process; 11 s to build and 3 s to trace on an idle core of the
  2-core reference machine, up to 50 s under load).

:func:`trace_zoo_model` builds and traces one entry (one training step, forward and backward), at
its batch size and at any other batch sizes asked for (the per-replica batches of the strategy
search, :func:`per_replica_batches`) while the model is alive, and frees the Keras model,
keeping only the IR graphs.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras

from partitioner.core.ir import Graph
from partitioner.planner.search import search_batches
from passes.trace import trace_model

__all__ = [
    "ZOO",
    "TracedZooModel",
    "ZooModel",
    "bert_base",
    "densenet121",
    "gpt2_small",
    "inception_v3",
    "lstm_nmt",
    "mlp",
    "mobilenet_v2",
    "multi_tower",
    "per_replica_batches",
    "resnet50",
    "trace_zoo_model",
    "transformer_1b",
    "transformer_lm",
    "zoo_model",
]

logger = logging.getLogger(__name__)

layers = keras.layers


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def resnet50() -> keras.Model:
    """ResNet50 (``keras.applications``, random weights), 224x224x3."""
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))


def inception_v3() -> keras.Model:
    """InceptionV3 (``keras.applications``, random weights), 299x299x3: the branchy CNN."""
    return keras.applications.InceptionV3(weights=None, input_shape=(299, 299, 3))


def mobilenet_v2() -> keras.Model:
    """MobileNetV2 (``keras.applications``, random weights), 224x224x3."""
    return keras.applications.MobileNetV2(weights=None, input_shape=(224, 224, 3))


def densenet121() -> keras.Model:
    """DenseNet121 (``keras.applications``, random weights), 224x224x3."""
    return keras.applications.DenseNet121(weights=None, input_shape=(224, 224, 3))


def transformer_lm(
    *,
    name: str,
    blocks: int,
    d_model: int,
    heads: int,
    ffn: int,
    seq: int,
    vocab: int,
    causal: bool,
    pre_norm: bool,
) -> keras.Model:
    """A Transformer stack from Keras layers: token and position embeddings, ``blocks`` blocks
    (MultiHeadAttention, Add, LayerNormalization, Dense(ffn, gelu), Dense(d_model)), an LM head.

    ``causal`` masks attention to earlier positions (a decoder); ``pre_norm`` puts the layer norm
    before each sub-block (GPT-2) instead of after the residual add (BERT). Two int32 inputs:
    the token ids and the position ids (``0..seq-1``).
    """
    tokens = keras.Input(shape=(seq,), dtype="int32", name="tokens")
    positions = keras.Input(shape=(seq,), dtype="int32", name="positions")
    x = layers.Add(name="embed_sum")(
        [
            layers.Embedding(vocab, d_model, name="token_embed")(tokens),
            layers.Embedding(seq, d_model, name="position_embed")(positions),
        ]
    )
    for b in range(blocks):
        h = layers.LayerNormalization(name=f"ln_attn_{b}")(x) if pre_norm else x
        attn = layers.MultiHeadAttention(heads, d_model // heads, name=f"mha_{b}")(
            h, h, use_causal_mask=causal
        )
        x = layers.Add(name=f"add_attn_{b}")([x, attn])
        if not pre_norm:
            x = layers.LayerNormalization(name=f"ln_attn_{b}")(x)
        h = layers.LayerNormalization(name=f"ln_ffn_{b}")(x) if pre_norm else x
        h = layers.Dense(ffn, activation="gelu", name=f"ffn_in_{b}")(h)
        h = layers.Dense(d_model, name=f"ffn_out_{b}")(h)
        x = layers.Add(name=f"add_ffn_{b}")([x, h])
        if not pre_norm:
            x = layers.LayerNormalization(name=f"ln_ffn_{b}")(x)
    if pre_norm:
        x = layers.LayerNormalization(name="ln_final")(x)
    logits = layers.Dense(vocab, name="lm_head")(x)
    return keras.Model([tokens, positions], logits, name=name)


def bert_base() -> keras.Model:
    """A BERT-base-sized encoder: 12 post-LN blocks, 768 wide, 12 heads, FFN 3072, seq 128."""
    return transformer_lm(
        name="bert_base",
        blocks=12,
        d_model=768,
        heads=12,
        ffn=3072,
        seq=128,
        vocab=30522,
        causal=False,
        pre_norm=False,
    )


def gpt2_small() -> keras.Model:
    """A GPT-2-small-sized decoder: 12 pre-LN causal blocks, 768 wide, 12 heads, context 1024."""
    return transformer_lm(
        name="gpt2_small",
        blocks=12,
        d_model=768,
        heads=12,
        ffn=3072,
        seq=1024,
        vocab=50257,
        causal=True,
        pre_norm=True,
    )


def transformer_1b(blocks: int = 20) -> keras.Model:
    """A GPT-style decoder of about 1.1 B parameters (``blocks`` = 20): 2048 wide, 16 heads,
    FFN 8192, context 512, vocabulary 32000."""
    return transformer_lm(
        name="transformer_1b",
        blocks=blocks,
        d_model=2048,
        heads=16,
        ffn=8192,
        seq=512,
        vocab=32000,
        causal=True,
        pre_norm=True,
    )


def lstm_nmt(
    *, seq: int = 40, vocab: int = 32000, units: int = 1024, depth: int = 4
) -> keras.Model:
    """An LSTM encoder-decoder with dot-product attention (the device-placement papers' NMT).

    ``depth`` LSTM layers each side; the decoder's first layer starts from the encoder's final
    state; the top decoder layer attends over the top encoder layer; a softmax projection to the
    target vocabulary. Two int32 inputs: source and (shifted) target token ids.
    """
    src = keras.Input(shape=(seq,), dtype="int32", name="source")
    tgt = keras.Input(shape=(seq,), dtype="int32", name="target")
    x = layers.Embedding(vocab, units, name="src_embed")(src)
    state: list[keras.KerasTensor] = []
    for k in range(depth):
        x, h, c = layers.LSTM(units, return_sequences=True, return_state=True, name=f"enc_{k}")(x)
        if k == depth - 1:
            state = [h, c]
    enc = x
    y = layers.Embedding(vocab, units, name="tgt_embed")(tgt)
    for k in range(depth):
        y = layers.LSTM(units, return_sequences=True, name=f"dec_{k}")(
            y, initial_state=state if k == 0 else None
        )
    context = layers.Attention(name="attention")([y, enc])
    y = layers.Concatenate(name="attn_concat")([y, context])
    y = layers.Dense(units, activation="tanh", name="attn_proj")(y)
    logits = layers.Dense(vocab, name="softmax_proj")(y)
    return keras.Model([src, tgt], logits, name="lstm_nmt")


def multi_tower(
    *, towers: int = 8, depth: int = 3, width: int = 4096, features: int = 2048
) -> keras.Model:
    """A wide multi-tower MLP: ``towers`` independent stacks of ``depth`` Dense(``width``) layers
    on one input, concatenated, then Dense(1000)."""
    inp = keras.Input(shape=(features,), name="features")
    outs = []
    for t in range(towers):
        x = inp
        for k in range(depth):
            x = layers.Dense(width, activation="relu", name=f"tower{t}_dense{k}")(x)
        outs.append(layers.Dense(512, activation="relu", name=f"tower{t}_out")(x))
    merged = layers.Concatenate(name="concat")(outs)
    logits = layers.Dense(1000, name="head")(merged)
    return keras.Model(inp, logits, name="multi_tower")


def mlp(*, width: int = 256, depth: int = 4, features: int = 64) -> keras.Model:
    """A tiny MLP (the runner's smoke test; not in :data:`ZOO`)."""
    inp = keras.Input(shape=(features,), name="features")
    x = inp
    for k in range(depth):
        x = layers.Dense(width, activation="relu", name=f"dense_{k}")(x)
    logits = layers.Dense(10, name="head")(x)
    return keras.Model(inp, logits, name="mlp")


# --------------------------------------------------------------------------------------------
# The zoo
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooModel:
    """One benchmark model: how to build it, the batch it is traced at, the device it targets."""

    name: str
    build: Callable[[], keras.Model]
    batch_size: int
    device_type: str
    description: str
    needs_split: bool = False
    """Whether the model is meant not to fit one device of ``device_type`` (the too-big model)."""


ZOO: tuple[ZooModel, ...] = (
    ZooModel("resnet50", resnet50, 32, "h100", "ResNet50, 224x224"),
    ZooModel("inception_v3", inception_v3, 32, "h100", "InceptionV3, 299x299 (branchy)"),
    ZooModel("mobilenet_v2", mobilenet_v2, 32, "h100", "MobileNetV2, 224x224"),
    ZooModel("densenet121", densenet121, 32, "h100", "DenseNet121, 224x224"),
    ZooModel("bert_base", bert_base, 32, "h100", "BERT-base encoder, seq 128"),
    ZooModel("gpt2_small", gpt2_small, 8, "h100", "GPT-2-small decoder, context 1024"),
    ZooModel("lstm_nmt", lstm_nmt, 64, "h100", "LSTM NMT 4+4 x 1024 with attention, 40 tokens"),
    ZooModel("multi_tower", multi_tower, 256, "h100", "8 towers x 3 Dense(4096)"),
    ZooModel(
        "transformer_1b",
        transformer_1b,
        8,
        "v100-16gb",
        "1.1B-parameter decoder, context 512 (too big for one 16 GB device)",
        needs_split=True,
    ),
)
"""Every benchmark model, in table order."""


def zoo_model(name: str) -> ZooModel:
    """The zoo entry called ``name``; ``KeyError`` naming the known ones otherwise."""
    for entry in ZOO:
        if entry.name == name:
            return entry
    raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(e.name for e in ZOO)}")


@dataclass(frozen=True)
class TracedZooModel:
    """A zoo entry traced into the IR, with what it cost to get there."""

    entry: ZooModel
    graph: Graph
    num_params: int
    build_time_s: float
    trace_time_s: float
    flops_time_s: float
    graphs_at: tuple[tuple[int, Graph], ...] = ()
    """The model traced at other batch sizes (``(batch, graph)``, ascending): the per-replica
    batches of the strategy search; ``graph`` is the one at the entry's batch."""
    extra_trace_time_s: float = 0.0
    """Wall time of the traces at the other batch sizes (with their FLOPs)."""

    def graph_at(self, batch_size: int) -> Graph:
        """The graph traced at ``batch_size``; ``KeyError`` naming the traced ones otherwise."""
        if batch_size == self.graph.batch_size:
            return self.graph
        for batch, graph in self.graphs_at:
            if batch == batch_size:
                return graph
        known = sorted({self.graph.batch_size, *(b for b, _ in self.graphs_at)})
        raise KeyError(f"{self.entry.name} was not traced at batch {batch_size}; traced: {known}")

    def describe(self) -> str:
        g = self.graph
        return (
            f"{self.entry.name}: {self.num_params / 1e6:.1f} M params, {len(g.ops)} ops, "
            f"{len(g.layers)} layers, batch {g.batch_size}, {self.entry.device_type}; built in "
            f"{self.build_time_s:.1f} s, traced in {self.trace_time_s:.1f} s "
            f"(+{self.flops_time_s:.1f} s FLOPs)"
            + (
                f"; also traced at batch {', '.join(str(b) for b, _ in self.graphs_at)} in "
                f"{self.extra_trace_time_s:.1f} s"
                if self.graphs_at
                else ""
            )
        )


def per_replica_batches(batch_size: int, max_devices: int) -> tuple[int, ...]:
    """Every batch but ``batch_size`` the strategy search costs a model at on up to
    ``max_devices`` devices (descending: each replica's share, each micro-batch;
    :func:`partitioner.planner.search.search_batches`)."""
    return tuple(b for b in search_batches(max_devices, batch_size) if b != batch_size)


def trace_zoo_model(entry: ZooModel, extra_batch_sizes: Sequence[int] = ()) -> TracedZooModel:
    """Build ``entry``'s model, trace one training step at its batch size (and at each of
    ``extra_batch_sizes``, while the model is alive), free the model."""
    t0 = time.perf_counter()
    model = entry.build()
    build_time_s = time.perf_counter() - t0
    num_params = int(model.count_params())
    traced = trace_model(model, batch_size=entry.batch_size)
    t1 = time.perf_counter()
    graphs_at = tuple(
        (b, trace_model(model, batch_size=b).graph)
        for b in sorted(set(extra_batch_sizes) - {entry.batch_size})
    )
    extra_trace_time_s = time.perf_counter() - t1
    del model
    keras.backend.clear_session()
    gc.collect()
    logger.info("traced %s: %d ops", entry.name, len(traced.graph.ops))
    return TracedZooModel(
        entry=entry,
        graph=traced.graph,
        num_params=num_params,
        build_time_s=build_time_s,
        trace_time_s=traced.trace_time_s,
        flops_time_s=traced.flops_time_s,
        graphs_at=graphs_at,
        extra_trace_time_s=extra_trace_time_s,
    )
