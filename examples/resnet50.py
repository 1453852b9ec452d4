"""ResNet50 from keras.applications with random weights (nothing is downloaded).

    partition examples/resnet50.py --gpus 2 --batch-size 32
"""

from __future__ import annotations

import keras


def build_model() -> keras.Model:
    return keras.applications.ResNet50(weights=None)


if __name__ == "__main__":
    import numpy as np

    model = build_model()
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    x = np.random.default_rng(0).random((4, 224, 224, 3), dtype=np.float32)
    y = keras.utils.to_categorical(np.arange(4) % 1000, 1000)
    model.fit(x, y, epochs=1, batch_size=2, verbose=2)
