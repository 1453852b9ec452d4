"""Issue 17, group 6: a plan's NOT EXACT warnings see layers nested in blocks and nested models,
and say nothing of layers that are exact (rate 0, frozen BatchNormalization)."""

from __future__ import annotations

from typing import Any

import keras

import partitioner


class Block(keras.layers.Layer):
    """A block holding a Dense and a Dropout (rate 0.5) in attributes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.dropout(self.dense(inputs), training=training)


def _chain(middle: Any) -> keras.Model:
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, name="first")(inputs)
    h = middle(h)
    h = keras.layers.Dense(8, name="third")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="last")(h), name="chain")


def _not_exact(model: keras.Model) -> list[str]:
    plan = partitioner.partition(model, gpus=2, batch_size=8, solver="even", pipeline=True)
    assert plan.pipeline is not None and plan.pipeline.num_microbatches > 1
    return [w for w in plan.warnings if w.startswith("NOT EXACT")]


def test_a_dropout_inside_a_block_is_warned_about() -> None:
    warned = _not_exact(_chain(Block(name="block")))
    assert len(warned) == 1 and warned[0].startswith("NOT EXACT: Dropout (block/"), warned


def test_exact_layers_are_not_warned_about() -> None:
    frozen = keras.layers.BatchNormalization(name="frozen")
    frozen.trainable = False
    block = keras.Sequential([keras.layers.Dropout(0.0), frozen], name="exact_block")
    assert _not_exact(_chain(block)) == []
