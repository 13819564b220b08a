"""`IPUStrategy`: run Keras models created in its scope on the IPU system."""

from keras_ipu.keras.strategy import IPUStrategy, IPUStrategyV1

__all__ = ["IPUStrategy", "IPUStrategyV1"]
