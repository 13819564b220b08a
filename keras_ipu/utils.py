"""General utilities: the device model's execution report."""

from keras_ipu.keras.report import execution_report

__all__ = ["execution_report"]
