"""TOML run configuration: ``load(file, overrides)`` -> ``RunConfig``; ``config.build`` turns one
into the TorchTitan ``Trainer.Config`` that runs it."""

from canon_titan.config.loader import CLI, load, parse_overrides, resolve
from canon_titan.config.run import ConfigError, RunConfig
from canon_titan.config.toml_writer import dumps, run_toml

__all__ = [
    "CLI",
    "ConfigError",
    "RunConfig",
    "dumps",
    "load",
    "parse_overrides",
    "resolve",
    "run_toml",
]
