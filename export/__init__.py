"""Export recipes: one TOML file per `--arch` preset (importable as `edgemem.recipes`)."""
