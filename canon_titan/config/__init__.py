"""TOML run configuration: ``load(file, overrides)`` -> ``RunConfig`` -> ``build_trainer_config``."""

from canon_titan.config.build import build_trainer_config
from canon_titan.config.loader import CLI, ConfigError, RunConfig, load, parse_overrides, resolve
from canon_titan.config.toml_writer import dumps

__all__ = ["CLI", "ConfigError", "RunConfig", "build_trainer_config", "dumps", "load", "parse_overrides", "resolve"]
