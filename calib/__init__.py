"""Calibration recipes: one TOML file per recipe (importable as `edgemem.calib`)."""
