"""A deep fully connected network worth splitting across two devices (Keras Functional API).

The seed article's two-device example pinned the halves of a small dense net to two GPUs by hand
with ``tf.device``; this is the TF2/Keras 3 version, deepened to four 1024-wide hidden layers so that
a split between two devices is meaningful: 100 features -> 4 x Dense 1024 (relu) -> Dense 10
(softmax). The partitioner finds the split instead of the author. Running this file trains it briefly
on synthetic data.
"""

from __future__ import annotations

import keras
import numpy as np

INPUT_DIM = 100
HIDDEN = 1024
DEPTH = 4
NUM_CLASSES = 10


def build_model() -> keras.Model:
    """The dense net, compiled with Adam and sparse categorical cross-entropy."""
    inputs = keras.Input(shape=(INPUT_DIM,), name="features")
    h = inputs
    for i in range(DEPTH):
        h = keras.layers.Dense(HIDDEN, activation="relu", name=f"hidden_{i}")(h)
    outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax", name="classifier")(h)
    model = keras.Model(inputs, outputs, name="two_device_dense")
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def synthetic_data(num_samples: int = 1024, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian features and integer labels that depend on them (so there is something to learn)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, INPUT_DIM)).astype(np.float32)
    w = rng.standard_normal((INPUT_DIM, NUM_CLASSES)).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int32)


if __name__ == "__main__":
    model = build_model()
    model.summary()
    x, y = synthetic_data()
    model.fit(x, y, batch_size=64, epochs=3, validation_split=0.1)
