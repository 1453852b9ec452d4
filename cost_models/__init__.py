"""Cost models: device catalog, roofline, communication, memory. Pure Python; no TensorFlow."""
