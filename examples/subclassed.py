"""A subclassed ``keras.Model``: a residual MLP whose sublayers are made in ``__init__``.

Its constructor takes only serialisable arguments (``hidden``, ``num_classes``), which Keras
records as the model's config, so the partitioner can rebuild a copy of it from
``get_config()``/``from_config()`` when it places the layers on devices. A subclassed model has no
symbolic inputs; ``build_model`` builds it by calling it once on a batch of zeros.

Running this file trains it briefly on synthetic data.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

INPUT_DIM = 64


class ResidualMLP(keras.Model):
    """Dense in -> (Dense + skip) -> LayerNormalization -> Dense out (softmax)."""

    def __init__(self, hidden: int = 256, num_classes: int = 10, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden = hidden
        self.num_classes = num_classes
        self.encode = keras.layers.Dense(hidden, activation="relu")
        self.block = keras.layers.Dense(hidden, activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.classify = keras.layers.Dense(num_classes, activation="softmax")

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        h = self.encode(inputs)
        h = self.norm(h + self.block(h))
        return self.classify(h)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "hidden": self.hidden, "num_classes": self.num_classes}


def build_model() -> keras.Model:
    """A built (not compiled) ResidualMLP: called once on zeros to create its weights."""
    model = ResidualMLP(hidden=256, num_classes=10, name="residual_mlp")
    model(np.zeros((1, INPUT_DIM), dtype=np.float32))
    return model


def synthetic_data(num_samples: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian features and integer labels that depend on them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, INPUT_DIM)).astype(np.float32)
    w = rng.standard_normal((INPUT_DIM, 10)).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int32)


if __name__ == "__main__":
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.summary()
    x, y = synthetic_data()
    model.fit(x, y, batch_size=64, epochs=3)
