"""Rewrites that realise a plan on a Keras model: per-layer device placement with colocated
gradients (:mod:`.device_placement`), pipeline stages with micro-batches (:mod:`.pipeline`),
applying a plan (:mod:`.apply`) and emitting a placed module (:mod:`.codegen`)."""
