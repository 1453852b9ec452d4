"""Measured costs on the devices present (these modules import TensorFlow): per-layer profiles
with a disk cache (:mod:`.profiled`) and per-op times inside the traced step (:mod:`.op_profile`)."""
