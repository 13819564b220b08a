"""The IPU device model: virtual IPUs on JAX devices, device programs, accounting.

Pure JAX; nothing in this package imports Keras.
"""
