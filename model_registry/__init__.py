"""Model families by name: ``[model] name + flavor`` -> TorchTitan ``ModelSpec``.

Each family is a module here with ``FAMILY`` (its ``canon_titan.models`` family: args, parallelism,
state-dict adapter) and ``FLAVORS`` (named presets of its args). This is the only place a model
name is looked up.
"""

from __future__ import annotations

import dataclasses
import importlib

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.protocols.model_spec import ModelSpec

from canon_titan.hf import register

FAMILIES = ("llama", "llama_canon", "gla5", "gdn2", "mamba2")


class UnknownModelError(ValueError):
    pass


def family(name: str):
    """The registry module of ``name`` (``FAMILY``, ``FLAVORS``)."""
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


def spec_from_args(name: str, flavor: str, args) -> ModelSpec:
    """The ModelSpec of a model whose args are resolved (``args.model_config()`` builds its config)."""
    fam = family(name).FAMILY
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=args.model_config(),
        parallelize_fn=fam.parallelize,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=fam.state_dict_adapter,
    )


def model_spec(name: str, flavor: str, overrides: dict | None = None) -> ModelSpec:
    return spec_from_args(name, flavor, model_args(name, flavor, overrides))


def register_with_transformers() -> None:
    """Make transformers' Auto classes know every family's model types (exports then load without
    ``trust_remote_code``)."""
    register({hf for name in FAMILIES for hf in family(name).FAMILY.hf_models})
