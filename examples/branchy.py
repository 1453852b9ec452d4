"""A branchy Functional model: every graph shape the partitioner has to handle in one place.

* an inception-like block: a convolutional stem feeding two parallel towers (a 1x1 and a 3x3
  convolution), each pooled to a vector;
* one Dense layer, ``shared_proj``, applied to both towers (a shared layer called twice, so it
  owns the ops of both calls and its weights get the gradients of both);
* a ``keras.ops.add`` of the two projections (a functional-API op, not a layer) and a
  Concatenate of the projections and their sum;
* a nested ``Sequential`` classifier head.

Running this file trains it briefly on random synthetic images.
"""

from __future__ import annotations

import keras
import numpy as np

IMAGE_SHAPE = (16, 16, 3)
NUM_CLASSES = 10


def _head() -> keras.Sequential:
    return keras.Sequential(
        [
            keras.Input(shape=(96,)),
            keras.layers.Dense(64, activation="relu", name="head_hidden"),
            keras.layers.Dense(NUM_CLASSES, activation="softmax", name="head_out"),
        ],
        name="head",
    )


def build_model() -> keras.Model:
    """The branchy model, compiled with Adam and sparse categorical cross-entropy."""
    inputs = keras.Input(shape=IMAGE_SHAPE, name="image")
    stem = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="stem")(inputs)
    tower_a = keras.layers.Conv2D(16, 1, activation="relu", name="tower_1x1")(stem)
    tower_b = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="tower_3x3")(stem)
    vec_a = keras.layers.GlobalAveragePooling2D(name="pool_a")(tower_a)
    vec_b = keras.layers.GlobalMaxPooling2D(name="pool_b")(tower_b)
    shared = keras.layers.Dense(32, activation="tanh", name="shared_proj")
    proj_a = shared(vec_a)
    proj_b = shared(vec_b)
    both = keras.ops.add(proj_a, proj_b)
    merged = keras.layers.Concatenate(name="merge")([proj_a, proj_b, both])
    outputs = _head()(merged)
    model = keras.Model(inputs, outputs, name="branchy")
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def synthetic_data(num_samples: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random images in [0, 1) and random integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.random((num_samples, *IMAGE_SHAPE), dtype=np.float32)
    return x, rng.integers(0, NUM_CLASSES, size=num_samples).astype(np.int32)


if __name__ == "__main__":
    model = build_model()
    model.summary()
    x, y = synthetic_data()
    model.fit(x, y, batch_size=32, epochs=2)
