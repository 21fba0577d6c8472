"""Model families by name: ``[model] name + flavor`` -> TorchTitan ``ModelSpec``.

Each family is a module here with ``ARGS`` (the dataclass of its TOML ``[model]`` keys) and
``FLAVORS`` (named presets of those args). This is the only place a model name is looked up.
"""

from __future__ import annotations

import dataclasses
import importlib

FAMILIES = ("llama", "llama_canon", "gla5", "gdn2", "mamba2")
LINEAR_FAMILIES = ("gla5", "gdn2", "mamba2")


class UnknownModelError(ValueError):
    pass


def family(name: str):
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


def model_spec(name: str, flavor: str, overrides: dict | None = None):
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.protocols.model_spec import ModelSpec

    from canon_titan.parallelize import parallelize_llama_canon
    from canon_titan.parallelize_linear import parallelize_linear

    args = model_args(name, flavor, overrides)
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=args.model_config(),
        parallelize_fn=parallelize_linear if name in LINEAR_FAMILIES else parallelize_llama_canon,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
