"""MNIST-style multilayer perceptron, as a Keras ``Sequential`` model.

784 flattened pixels -> Dense 512 (relu) -> Dropout 0.2 -> Dense 512 (relu) -> Dropout 0.2
-> Dense 10 (softmax): the classic MNIST MLP of the seed article. Running this file trains it for a
couple of epochs on random synthetic "images" (nothing is downloaded).
"""

from __future__ import annotations

import keras
import numpy as np

INPUT_DIM = 784
NUM_CLASSES = 10


def build_model() -> keras.Model:
    """The MLP, compiled with RMSprop and categorical cross-entropy."""
    model = keras.Sequential(
        [
            keras.Input(shape=(INPUT_DIM,)),
            keras.layers.Dense(512, activation="relu", name="dense_in"),
            keras.layers.Dropout(0.2, name="dropout_in"),
            keras.layers.Dense(512, activation="relu", name="dense_hidden"),
            keras.layers.Dropout(0.2, name="dropout_hidden"),
            keras.layers.Dense(NUM_CLASSES, activation="softmax", name="dense_out"),
        ],
        name="mnist_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
        loss="categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def synthetic_data(num_samples: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random pixels in [0, 1) and one-hot labels."""
    rng = np.random.default_rng(seed)
    x = rng.random((num_samples, INPUT_DIM), dtype=np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=num_samples)
    return x, np.eye(NUM_CLASSES, dtype=np.float32)[labels]


if __name__ == "__main__":
    model = build_model()
    model.summary()
    x, y = synthetic_data()
    model.fit(x, y, batch_size=64, epochs=2, validation_split=0.1)
