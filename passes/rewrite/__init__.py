"""Rewrites that realise a plan on a Keras model: per-layer device placement with colocated
gradients (:mod:`.device_placement`), pipeline stages with micro-batches (:mod:`.pipeline`)
and emitting a placed module (:mod:`.codegen`). :mod:`passes.apply` chooses among them (and
:mod:`passes.cluster`) for a plan."""
