"""Model families by name: ``[model] name + flavor`` -> TorchTitan ``ModelSpec``.

Each family is a module here with ``ARGS`` (the dataclass of its ``[model]`` keys) and ``FLAVORS``
(named presets of them). This is the only place a model name is looked up. Reading and checking a
config needs only these, which import no model code; ``model_family`` imports the family's
modules (parallelism, Hugging Face format) when a model is built, converted or registered.
"""

from __future__ import annotations

import dataclasses
import importlib

from canon_titan.hf import register

FAMILIES = ("llama", "llama_canon", "gla5", "gdn2", "mamba2")


class UnknownModelError(ValueError):
    pass


def family(name: str):
    """The registry module of ``name`` (``ARGS``, ``FLAVORS``)."""
    if name not in FAMILIES:
        raise UnknownModelError(f"unknown model name {name!r}; available: {', '.join(FAMILIES)}")
    return importlib.import_module(f"model_registry.{name}")


def model_args(name: str, flavor: str, overrides: dict | None = None):
    """The flavor's args with per-field overrides applied (a fresh copy)."""
    fam = family(name)
    if flavor not in fam.FLAVORS:
        raise UnknownModelError(
            f"unknown flavor {flavor!r} for model {name!r}; available: {', '.join(fam.FLAVORS)}"
        )
    return dataclasses.replace(fam.FLAVORS[flavor], **(overrides or {}))


def model_family(name: str):
    """The ``ModelFamily`` of ``name`` (imports its model code)."""
    family(name)
    return importlib.import_module(f"canon_titan.models.{name}.family").FAMILY


def spec_from_args(name: str, flavor: str, args):
    """The TorchTitan ModelSpec of a model whose args are resolved."""
    return model_family(name).spec(flavor, args)


def model_spec(name: str, flavor: str, overrides: dict | None = None):
    return spec_from_args(name, flavor, model_args(name, flavor, overrides))


def register_with_transformers() -> None:
    """Make transformers' Auto classes know every family's model types (exports then load without
    ``trust_remote_code``)."""
    register({hf for name in FAMILIES for hf in model_family(name).hf_models})
