"""The shipped presets: one TOML recipe per `--arch` (read by `edgemem.models.recipes`)."""
