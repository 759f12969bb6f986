"""The shipped calibration recipes: one TOML file per `--recipe` name (read by `edgemem.quant.recipe`)."""
