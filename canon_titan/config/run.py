"""A resolved run: every section with every key filled in, and the model it trains."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import model_registry
from synthetic_data.tasks import SECTION, make_task


class ConfigError(ValueError):
    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")


@dataclass(eq=False)
class RunConfig:
    source: str
    sections: dict[str, dict[str, Any]]
    model_args: Any = None
    """The model family's args, built once from the resolved ``[model]`` section."""
    origins: dict[tuple[str, str], str] = field(default_factory=dict)
    """Where each explicitly set key came from (the file or the command line)."""
    tokenizer_vocab: int | None = None
    """The vocabulary of the run's tokenizer, when it could be read (text datasets)."""
    weights_vocab: int | None = None
    """The vocabulary of weights being converted without a tokenizer beside them (``convert
    from-hf``):
    ``[model] vocab_size`` follows it instead of the tokenizer's, which it need not match."""

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self.sections[section]

    def error(self, section: str, key: str, message: str) -> ConfigError:
        """A problem with ``[section] key``, attributed to where the key was set."""
        return ConfigError(
            self.origins.get((section, key), self.source), f"[{section}] {key}", message
        )

    @functools.cached_property
    def _spec(self):
        model = self.sections["model"]
        return model_registry.spec_from_args(model["name"], model["flavor"], self.model_args)

    def model_spec(self):
        """The TorchTitan ModelSpec of this run's model (built once; without float8 conversion)."""
        return self._spec

    def label(self) -> str:
        """The config file and its model, for messages: ``FILE (NAME FLAVOR)``."""
        return (
            f"{self.source} ({self.sections['model']['name']} {self.sections['model']['flavor']})"
        )

    def state_dict_adapter(self, rope_layout: str = "lingua"):
        """The model family's Hugging Face format for this run's model."""
        spec = self.model_spec()
        return spec.state_dict_adapter(spec.model, rope_layout=rope_layout)

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks (TorchTitan's batch degree) of this run on ``world_size``
        processes:
        ``data_parallel_shard_degree`` (-1: the ranks the other degrees leave) x replicate."""
        par = self.sections["parallelism"]
        shard = par["data_parallel_shard_degree"]
        if shard == -1:
            others = (
                par["data_parallel_replicate_degree"]
                * par["tensor_parallel_degree"]
                * par["pipeline_parallel_degree"]
                * par["context_parallel_degree"]
            )
            shard = max(1, world_size // others)
        return shard * par["data_parallel_replicate_degree"]

    @functools.cached_property
    def task(self):
        """The synthetic task of ``[dataloader] dataset`` with its resolved parameters (None for
        text)."""
        dataset = self.sections["dataloader"]["dataset"]
        if dataset not in SECTION:
            return None
        return make_task(
            dataset, **{k: v for k, v in self.sections[SECTION[dataset]].items() if v is not None}
        )
