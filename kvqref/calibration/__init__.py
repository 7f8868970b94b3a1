"""Calibrated static K/V scales: compute them from a model's activations (:mod:`.scales`), read and write
them in the engines' files (:mod:`.files`), and compare them with the engines' defaults
(:mod:`.compare`). The command is ``kvqref calibrate`` (:mod:`.command`)."""

from kvqref.calibration.files import FORMATS, load, load_sglang_scales, save
from kvqref.calibration.scales import GRANULARITIES, METHODS, SCHEMES, ScaleSet, calibrate, calibrate_tensor

__all__ = ["FORMATS", "GRANULARITIES", "METHODS", "SCHEMES", "ScaleSet", "calibrate", "calibrate_tensor", "load",
           "load_sglang_scales", "save"]
