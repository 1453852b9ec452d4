"""A small convolutional image classifier for 32x32 RGB inputs (CIFAR-10 sized).

Conv2D 32 -> BatchNormalization -> MaxPooling -> Conv2D 64 -> GlobalAveragePooling -> Dense 10
(softmax), Functional API. Running this file trains it briefly on random synthetic images.
"""

from __future__ import annotations

import keras
import numpy as np

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


def build_model() -> keras.Model:
    """The CNN, compiled with Adam and sparse categorical cross-entropy."""
    inputs = keras.Input(shape=IMAGE_SHAPE, name="image")
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv_1")(inputs)
    h = keras.layers.BatchNormalization(name="bn_1")(h)
    h = keras.layers.MaxPooling2D(2, name="pool_1")(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv_2")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax", name="classifier")(h)
    model = keras.Model(inputs, outputs, name="small_cnn")
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
