"""General utilities: the device model's execution report and weight placement."""

from keras_ipu.keras.report import execution_report, weight_placement

__all__ = ["execution_report", "weight_placement"]
