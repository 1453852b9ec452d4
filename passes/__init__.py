"""Passes over models: trace (Keras -> IR) and the device-placement rewrite. These touch TensorFlow."""
