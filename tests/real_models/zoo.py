"""The real-model zoo (issue 17): public architectures at reduced sizes with random weights.

Nothing is downloaded: every ``keras.applications`` model is built with ``weights=None`` at a small
input (``include_top=False, pooling="avg"``), every keras_hub backbone from its config (no preset),
and the keras-io style models are written here after the keras.io examples they name.

Each :class:`Case` says how to build the model and a sample batch (``x`` and ``y``: arrays, lists
or dicts as the model takes them; ``y`` is ``None`` for a model whose own ``train_step`` needs no
targets), the ``input_shape`` ``partition`` needs for dynamic dimensions, whether the model is a
chain (then it is pipelined too), its Keras dtype policy, and whether it is heavy (marked slow).

The convolutional models with BatchNormalization run in float64: deep BatchNormalization stacks
on a batch of 4 amplify float32 rounding far above 1e-5 (see ``tests/sweep_models.py``), so only
float64 tells a faithful rewrite from a wrong one at that tolerance. Dropout and stochastic
depth rates are 0 (random masks cannot match between two models).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

BATCH = 4
"""The batch. BatchNormalization over one sample of a 1x1 map gives 0 (and every gradient 0), so
a CNN that ends on a 1x1 map at 32x32 is only placed (whole batch) or pipelined 2 ways."""
SEQ = 16
VOCAB = 64


@dataclass(frozen=True)
class Case:
    """One architecture of the zoo."""

    name: str
    source: str
    """Where it comes from: ``keras.applications.X``, ``keras_hub.models.X``, ``keras-io: ...``."""
    build: Callable[[], tuple[keras.Model, Any, Any]]
    """A fresh model, a batch ``x`` and targets ``y`` (``None``: the model's step takes none)."""
    chain: bool = False
    """A chain of layers: pipelined too (``pipeline=True``)."""
    heavy: bool = False
    """Marked slow (hundreds of layers, or a slow trace)."""
    dtype: str = "float32"
    input_shape: dict[str, tuple[int, ...]] | None = None
    """What ``partition(input_shape=...)`` needs (dynamic dimensions: one shape per input name),
    else ``None``."""
    draws: bool = False
    """Its own ``train_step`` draws random numbers per batch (a VAE's sampling): split into
    replicas, each draws for its share, so the reference is its step on each share (gradients
    averaged), not on the whole batch."""


@contextlib.contextmanager
def dtype_policy(name: str) -> Iterator[None]:
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(old)


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _images(side: int, dtype: str = "float32") -> np.ndarray:
    return _rng().standard_normal((BATCH, side, side, 3)).astype(dtype)


def _targets_like(outputs: Any) -> Any:
    """Random targets with the structure, shapes and dtypes of ``outputs``."""
    rng = np.random.default_rng(1)
    return keras.tree.map_structure(
        lambda t: rng.standard_normal(np.shape(t)).astype(np.asarray(t).dtype), outputs
    )


def _zero_dropout(model: keras.Model) -> keras.Model:
    """Every Dropout (and keras.applications' stochastic depth) of ``model`` drops nothing."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def _with_batch(model: keras.Model, x: Any) -> tuple[keras.Model, Any, Any]:
    return model, x, _targets_like(model(x, training=False))


# -- keras.applications --------------------------------------------------------------------------


def _application(fn_name: str, side: int, **kwargs: Any) -> Callable[[], Any]:
    def build() -> tuple[keras.Model, Any, Any]:
        fn = getattr(keras.applications, fn_name)
        model = fn(
            weights=None, include_top=False, pooling="avg", input_shape=(side, side, 3), **kwargs
        )
        dtype = keras.config.dtype_policy().name
        return _with_batch(_zero_dropout(model), _images(side, dtype))

    return build


def _app(
    name: str, fn_name: str, side: int = 32, chain: bool = False, heavy: bool = True, **kw: Any
) -> Case:
    return Case(
        name,
        f"keras.applications.{fn_name}",
        _application(fn_name, side, **kw),
        chain=chain,
        heavy=heavy,
        dtype="float64",
    )


# The deepest families at reduced depth and width, from the family builders that
# keras.applications' own constructors call (keras.src.applications: Keras's code, not a copy).


def _resnet(preact: bool) -> tuple[keras.Model, Any, Any]:
    from keras.src.applications import resnet

    stack = resnet.stack_residual_blocks_v2 if preact else resnet.stack_residual_blocks_v1

    def stack_fn(x: Any) -> Any:
        # ResNetV2's last block of a stack strides, so a V2 stack needs two blocks
        blocks = 2 if preact else 1
        x = stack(x, 8, blocks, stride1=1, name="conv2")
        x = stack(x, 16, blocks, name="conv3")
        return stack(x, 32, blocks, name="conv4")

    model = resnet.ResNet(
        stack_fn, preact, not preact, weights=None, include_top=False, pooling="avg",
        input_shape=(32, 32, 3), name="resnet_v2_small" if preact else "resnet_small",
    )  # fmt: skip
    return _with_batch(model, _images(32, keras.config.dtype_policy().name))


def _densenet() -> tuple[keras.Model, Any, Any]:
    from keras.src.applications import densenet

    model = densenet.DenseNet(
        [1, 2, 2, 1], weights=None, include_top=False, pooling="avg", input_shape=(32, 32, 3),
        name="densenet_small",
    )  # fmt: skip
    return _with_batch(model, _images(32, keras.config.dtype_policy().name))


def _efficientnet() -> tuple[keras.Model, Any, Any]:
    from keras.src.applications import efficientnet

    model = efficientnet.EfficientNet(
        0.25, 0.1, 32, dropout_rate=0.0, drop_connect_rate=0.0, weights=None,
        include_top=False, pooling="avg", input_shape=(32, 32, 3), name="efficientnet_small",
    )  # fmt: skip
    return _with_batch(model, _images(32, keras.config.dtype_policy().name))


def _convnext() -> tuple[keras.Model, Any, Any]:
    from keras.src.applications import convnext

    model = convnext.ConvNeXt(
        depths=[1, 1, 1, 1], projection_dims=[8, 16, 32, 64], weights=None, include_top=False,
        pooling="avg", input_shape=(32, 32, 3), name="convnext_small",
    )  # fmt: skip
    return _with_batch(model, _images(32, keras.config.dtype_policy().name))


def _efficientnet_v2() -> tuple[keras.Model, Any, Any]:
    from keras.src.applications import efficientnet_v2

    model = efficientnet_v2.EfficientNetV2(
        0.25, 0.1, 32, dropout_rate=0.0, drop_connect_rate=0.0, weights=None,
        include_top=False, pooling="avg", input_shape=(32, 32, 3),
        name="efficientnetv2-b0",  # the builder looks its blocks up by this name
    )  # fmt: skip
    return _with_batch(model, _images(32, keras.config.dtype_policy().name))


def _nasnet() -> tuple[keras.Model, Any, Any]:
    from keras.src.applications import nasnet

    model = nasnet.NASNet(
        input_shape=(32, 32, 3), penultimate_filters=96, num_blocks=1, stem_block_filters=8,
        weights=None, include_top=False, pooling="avg", default_size=32, name="nasnet_small",
    )  # fmt: skip
    return _with_batch(model, _images(32, keras.config.dtype_policy().name))


def _small(name: str, family: str, build: Callable[[], Any], heavy: bool = False) -> Case:
    source = f"keras.applications {family} family (keras.src builder, reduced)"
    return Case(name, source, build, heavy=heavy, dtype="float64")


APPLICATIONS = (
    _small("resnet_small", "ResNet", lambda: _resnet(False)),
    _small("resnet_v2_small", "ResNetV2", lambda: _resnet(True)),
    _app("vgg16", "VGG16", chain=True, heavy=False),
    _app("inception_v3", "InceptionV3", side=75),
    _app("xception", "Xception", side=71),
    _app("mobilenet", "MobileNet", chain=True, heavy=False, alpha=0.25),
    _app("mobilenet_v2", "MobileNetV2", alpha=0.35),
    _app("mobilenet_v3_small", "MobileNetV3Small", heavy=False, alpha=0.75, minimalistic=True),
    _small("densenet_small", "DenseNet", _densenet),
    _small("nasnet_small", "NASNet", _nasnet, heavy=True),
    _small("efficientnet_small", "EfficientNet", _efficientnet),
    _small("efficientnet_v2_small", "EfficientNetV2", _efficientnet_v2),
    _small("convnext_small", "ConvNeXt", _convnext),
)
"""Every keras.applications family of Keras 3.15 (RegNet is not in it)."""


# -- keras_hub backbones, from config ------------------------------------------------------------


def _tokens(*names: str, segment: bool = False) -> dict[str, np.ndarray]:
    rng = _rng()
    batch: dict[str, np.ndarray] = {}
    for prefix in names:
        batch[f"{prefix}token_ids"] = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
        batch[f"{prefix}padding_mask"] = np.ones((BATCH, SEQ), dtype="int32")
    if segment:
        batch["segment_ids"] = np.zeros((BATCH, SEQ), dtype="int32")
    return batch


TEXT = {"vocabulary_size": VOCAB, "num_layers": 2, "hidden_dim": 32, "intermediate_dim": 64}


def _hub(cls_name: str, x: Callable[[], Any], **kwargs: Any) -> Callable[[], Any]:
    def build() -> tuple[keras.Model, Any, Any]:
        import keras_hub

        return _with_batch(getattr(keras_hub.models, cls_name)(**kwargs), x())

    return build


def _hub_case(name: str, cls_name: str, x: Callable[[], Any], text: bool = True, **kw: Any) -> Case:
    shapes = {key: (SEQ,) for key in x()} if text else None
    return Case(name, f"keras_hub.models.{cls_name}", _hub(cls_name, x, **kw), input_shape=shapes)


DECODER = {**TEXT, "num_query_heads": 4, "num_key_value_heads": 2}
HUB = (
    _hub_case(
        "gpt2", "GPT2Backbone", lambda: _tokens(""), num_heads=2, max_sequence_length=32, dropout=0.0, **TEXT
    ),
    _hub_case(
        "bert",
        "BertBackbone",
        lambda: _tokens("", segment=True),
        num_heads=2,
        max_sequence_length=32,
        dropout=0.0,
        **TEXT,
    ),
    _hub_case("llama", "LlamaBackbone", lambda: _tokens(""), **DECODER),
    _hub_case("mistral", "MistralBackbone", lambda: _tokens(""), **DECODER),
    _hub_case(
        "vit",
        "ViTBackbone",
        lambda: _images(32),
        text=False,
        image_shape=(32, 32, 3),
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
    ),
    _hub_case(
        "t5",
        "T5Backbone",
        lambda: _tokens("encoder_", "decoder_"),
        num_heads=2,
        key_value_dim=16,
        dropout=0.0,
        **TEXT,
    ),
    _hub_case(
        "bart",
        "BartBackbone",
        lambda: _tokens("encoder_", "decoder_"),
        num_heads=2,
        max_sequence_length=32,
        dropout=0.0,
        **TEXT,
    ),
)


# -- keras-io style models -----------------------------------------------------------------------


class Linear(keras.layers.Layer):
    """keras-io "Making new layers and models via subclassing": a layer with its own weights and
    ``get_config``."""

    def __init__(self, units: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal")
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal")

    def call(self, inputs: Any) -> Any:
        return keras.ops.matmul(inputs, self.w) + self.b

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}


class ScaledResidual(keras.layers.Layer):
    """A custom layer without ``get_config`` whose constructor takes a required argument (the
    common keras-io shortcut): Keras cannot rebuild it from its config."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def build(self, input_shape: Any) -> None:
        self.gamma = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs: Any) -> Any:
        return inputs + self.scale * self.gamma * keras.ops.tanh(inputs)


def custom_layer_config() -> tuple[keras.Model, Any, Any]:
    inputs = keras.Input((16,), name="features")
    h = Linear(32, name="linear_1")(inputs)
    h = keras.layers.Activation("relu", name="relu_1")(h)
    h = Linear(32, name="linear_2")(h)
    h = keras.layers.Activation("relu", name="relu_2")(h)
    outputs = Linear(4, name="linear_out")(h)
    model = keras.Model(inputs, outputs, name="custom_layer_config")
    return _with_batch(model, _rng().standard_normal((BATCH, 16)).astype("float32"))


def custom_layer_no_config() -> tuple[keras.Model, Any, Any]:
    inputs = keras.Input((16,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    h = ScaledResidual(0.5)(h)
    h = keras.layers.Dense(32, activation="relu", name="dense_2")(h)
    outputs = keras.layers.Dense(4, name="dense_out")(h)
    model = keras.Model(inputs, outputs, name="custom_layer_no_config")
    return _with_batch(model, _rng().standard_normal((BATCH, 16)).astype("float32"))


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras-io "Text classification with Transformer": layers held in attributes, no
    ``get_config``."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int) -> None:
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x: Any) -> Any:
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    """keras-io "Text classification with Transformer" (dropout 0)."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int) -> None:
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs: Any) -> Any:
        out1 = self.layernorm1(inputs + self.att(inputs, inputs))
        return self.layernorm2(out1 + self.ffn(out1))


def text_transformer() -> tuple[keras.Model, Any, Any]:
    inputs = keras.Input(shape=(SEQ,), dtype="int32")
    x = TokenAndPositionEmbedding(SEQ, VOCAB, 16)(inputs)
    x = TransformerBlock(16, 2, 32)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(2)(x)
    model = keras.Model(inputs=inputs, outputs=outputs, name="text_transformer")
    return _with_batch(model, _rng().integers(0, VOCAB, (BATCH, SEQ)).astype("int32"))


def mnist_convnet() -> tuple[keras.Model, Any, Any]:
    """keras-io "Simple MNIST convnet" (14x14 inputs, dropout 0)."""
    model = keras.Sequential(
        [
            keras.Input(shape=(14, 14, 1)),
            keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.0),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="mnist_convnet",
    )
    x = _rng().standard_normal((BATCH, 14, 14, 1)).astype(keras.config.dtype_policy().name)
    return _with_batch(model, x)


class MLPSubclassed(keras.Model):
    """keras-io "The Model class": a subclassed model, layers in attributes, its own ``call``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense_1 = keras.layers.Dense(32, activation="relu")
        self.dense_2 = keras.layers.Dense(32, activation="relu")
        self.dense_3 = keras.layers.Dense(32, activation="relu")
        self.head = keras.layers.Dense(4)

    def call(self, inputs: Any) -> Any:
        return self.head(self.dense_3(self.dense_2(self.dense_1(inputs))))


def subclassed() -> tuple[keras.Model, Any, Any]:
    model = MLPSubclassed(name="subclassed")
    x = _rng().standard_normal((BATCH, 16)).astype("float32")
    model(x)
    return _with_batch(model, x)


class Sampling(keras.layers.Layer):
    """keras-io "Variational AutoEncoder": z = mean + exp(log_var / 2) * epsilon (epsilon from a
    fixed seed, so that two runs draw the same)."""

    def call(self, inputs: Any) -> Any:
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(keras.ops.shape(z_mean), seed=7)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """keras-io "Variational AutoEncoder": encoder and decoder models and a custom ``train_step``
    (reconstruction + KL loss, no targets)."""

    def __init__(self, encoder: keras.Model, decoder: keras.Model, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    def call(self, inputs: Any) -> Any:
        _, _, z = self.encoder(inputs)
        return self.decoder(z)

    @property
    def metrics(self) -> list[Any]:
        return [self.total_loss_tracker]

    def train_step(self, data: Any) -> dict[str, Any]:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = keras.ops.mean(keras.ops.square(data - reconstruction))
            kl = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
            total_loss = reconstruction_loss + keras.ops.mean(kl)
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        return {"loss": self.total_loss_tracker.result()}


def vae() -> tuple[keras.Model, Any, Any]:
    inputs = keras.Input((16,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    z_mean = keras.layers.Dense(2, name="z_mean")(h)
    z_log_var = keras.layers.Dense(2, name="z_log_var")(h)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")
    latent = keras.Input((2,))
    decoded = keras.layers.Dense(16)(keras.layers.Dense(16, activation="relu")(latent))
    decoder = keras.Model(latent, decoded, name="decoder")
    model = VAE(encoder, decoder, name="vae")
    x = _rng().standard_normal((BATCH, 16)).astype("float32")
    model(x)
    return model, x, None


class ActivityRegularization(keras.layers.Layer):
    """keras-io "Making new layers and models via subclassing": a loss added inside a layer
    (``add_loss``), no ``get_config``."""

    def __init__(self, rate: float = 1e-2) -> None:
        super().__init__()
        self.rate = rate

    def call(self, inputs: Any) -> Any:
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


class SharedBranches(keras.Model):
    """A subclassed model whose ``call`` branches on ``training``, with one layer shared by two
    branches and a layer adding a loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shared = keras.layers.Dense(16, activation="tanh")
        self.left = keras.layers.Dense(16)
        self.regularized = ActivityRegularization()
        self.head = keras.layers.Dense(4)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        h = self.shared(inputs)
        h = h + self.shared(self.left(h))  # the shared layer, on two branches
        if training:
            h = self.regularized(h)
        return self.head(h)


def shared_branches() -> tuple[keras.Model, Any, Any]:
    model = SharedBranches(name="shared_branches")
    x = _rng().standard_normal((BATCH, 16)).astype("float32")
    model(x)
    return _with_batch(model, x)


class GAN(keras.Model):
    """keras-io "GAN overriding Model.train_step" (dense, small): a generator and a
    discriminator, ``compile(d_optimizer, g_optimizer, loss_fn)``, two optimizers in its own
    ``train_step``, no targets. Its latent vectors come from the batch (``tanh`` of the real
    rows), not from a random draw, so that a batch split into replicas gives each replica its
    rows' latents (a draw per share cannot match the whole batch's). Its metrics are made in
    ``__init__`` (keras.io makes them in ``compile``, which Keras refuses on a built model)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")
        self.generator = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(16)],
            name="generator",
        )
        self.discriminator = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)],
            name="discriminator",
        )

    def call(self, latent: Any) -> Any:
        return self.discriminator(self.generator(latent))

    def compile(  # type: ignore[override]
        self, d_optimizer: Any, g_optimizer: Any, loss_fn: Any, **kwargs: Any
    ) -> None:
        super().compile(**kwargs)
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self) -> list[Any]:
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real: Any) -> dict[str, Any]:
        import tensorflow as tf

        latent = keras.ops.tanh(real)
        fake = self.generator(latent)
        rows = keras.ops.shape(real)[0]
        labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))])
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(keras.ops.concatenate([fake, real])))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(keras.ops.zeros((rows, 1)), self(latent))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"loss": self.g_loss_metric.result(), "d_loss": self.d_loss_metric.result()}


def gan() -> tuple[keras.Model, Any, Any]:
    model = GAN(name="gan")
    x = _rng().standard_normal((BATCH, 16)).astype("float32")
    model(x)
    return model, x, None


def multi_io() -> tuple[keras.Model, Any, Any]:
    """keras-io "The Functional API" ticket classifier: named dict inputs, dict outputs."""
    title = keras.Input(shape=(SEQ,), dtype="int32", name="title")
    body = keras.Input(shape=(SEQ,), dtype="int32", name="body")
    tags = keras.Input(shape=(6,), name="tags")
    title_features = keras.layers.LSTM(8)(keras.layers.Embedding(VOCAB, 8)(title))
    body_features = keras.layers.LSTM(8)(keras.layers.Embedding(VOCAB, 8)(body))
    x = keras.layers.concatenate([title_features, body_features, tags])
    priority = keras.layers.Dense(1, name="priority")(x)
    department = keras.layers.Dense(3, name="department")(x)
    model = keras.Model(
        inputs={"title": title, "body": body, "tags": tags},
        outputs={"priority": priority, "department": department},
        name="multi_io",
    )
    rng = _rng()
    x_batch = {
        "title": rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
        "body": rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
        "tags": rng.standard_normal((BATCH, 6)).astype("float32"),
    }
    return _with_batch(model, x_batch)


KERAS_IO = (
    Case(
        "custom_layer_config",
        "keras-io: Making new layers via subclassing",
        custom_layer_config,
        chain=True,
    ),
    Case("custom_layer_no_config", "keras-io: custom layer without get_config", custom_layer_no_config),
    Case("text_transformer", "keras-io: Text classification with Transformer", text_transformer),
    Case("mnist_convnet", "keras-io: Simple MNIST convnet", mnist_convnet, chain=True, dtype="float64"),
    Case("subclassed", "keras-io: The Model class (subclassed)", subclassed),
    Case("vae", "keras-io: Variational AutoEncoder (custom train_step)", vae, draws=True),
    Case("gan", "keras-io: GAN overriding train_step (two optimizers)", gan),
    Case(
        "shared_branches",
        "keras-io: subclassed, training branch, shared layer, add_loss",
        shared_branches,
    ),
    Case("multi_io", "keras-io: The Functional API (dict inputs and outputs)", multi_io),
)

CASES: tuple[Case, ...] = APPLICATIONS + HUB + KERAS_IO
BY_NAME = {case.name: case for case in CASES}


def build(name: str, seed: int = 0) -> tuple[keras.Model, Any, Any]:
    """A fresh model (weights drawn from ``seed``), its batch and targets, under its dtype."""
    keras.utils.set_random_seed(seed)
    return BY_NAME[name].build()
