"""Hugging Face format of a family: tensor names and layouts, and ``config.json``, as a TorchTitan
``StateDictAdapter``.

Each family's adapter lists every tensor of its Hugging Face model and the canon-titan tensors it
is made of (``layout``): usually one renamed tensor; rows stacked from several (the linear models'
fused [gate | up] projection); rows reordered (q/k channels in Hugging Face's rotate-half RoPE
layout); or a fixed value canon-titan has no counterpart for (a Mamba2 without b stores the
release's frozen identity convolution). From that one table come TorchTitan's ``to_hf`` /
``from_hf`` (``[checkpoint] last_save_in_hf`` and ``initial_load_in_hf``, on sharded DTensors) and
``canon-titan convert`` (tensor by tensor, from a DCP checkpoint or a safetensors folder).

The family also writes the export's ``config.json`` (``hf_config``) and checks that an imported one
describes the run's model (``accept``), which also tells it how the folder lays out its tensors.
"""

from __future__ import annotations

import json
import os
import re
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from canon_titan.hf import HFFormatError, HFModel

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CANON_FIELDS = {
    "canon_set": "",
    "canon_kernel": 4,
    "canon_residual": True,
    "canon_activation": False,
    "canon_bias": False,
}
"""The Canon fields of an export's config.json, and their values for a model without Canon
layers."""
CANON_BIAS_NOTE = (
    "canon_bias = true: the PhysicsLM4 release's LlamaCanon code cannot load this model (it has no "
    "Canon bias and asserts on one); load it with the modeling code shipped in this folder"
)
NOT_MATHS = {
    "architectures",
    "auto_map",
    "model_type",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "use_cache",
    "initializer_range",
    "attn_mode",
    "fuse_norm",
    "fuse_swiglu",
    "fuse_cross_entropy",
    "zeyuan_split_init",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
    "rescale_prenorm_residual",
    "residual_in_fp32",
    "chunk_size",
    "canon_titan_note",
    "rope_version",
    "partial_rotary_factor",
    "rope_parameters",
    "zeyuan_layernorm",
    "use_l2warp",
}
"""Fields of an export's config.json that do not change the function the model computes: ids,
initialisation, implementation choices (fused kernels, the scan's block length), and RoPE fields
that are compared in resolved form (``rope_dim``, ``rope_theta``) or that only say how q/k rows
are laid out (``rope_version``, read by ``accept``). Every other field is compared on import."""


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face model."""

    sources: tuple[str, ...] = ()
    """The canon-titan tensors it is made of, stacked along dim 0 in this order."""
    order: torch.Tensor | None = None
    """Rows of the stack in Hugging Face's order (HF row i is stacked row ``order[i]``), or None."""
    fixed: torch.Tensor | None = None
    """Or a value written as is and ignored on import (it has no canon-titan counterpart)."""

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The HF tensor from its sources' tensors (plain tensors)."""
        if self.fixed is not None:
            return self.fixed
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        return tensor if self.order is None else tensor[self.order]

    def split(self, tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """The sources' tensors (of ``rows`` rows each) from the HF tensor (plain tensors)."""
        if self.order is not None:
            tensor = tensor[torch.argsort(self.order)]
        return list(tensor.split(rows))


def _index_mapping(hf_assets_path: str | None) -> dict[str, int] | None:
    """TorchTitan's ``fqn_to_index_mapping`` from a ``model.safetensors.index.json`` next to the
    assets, or None (HF saves then write one file) -- without TorchTitan's warning when there is
    none."""
    path = os.path.join(hf_assets_path, "model.safetensors.index.json") if hf_assets_path else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        weight_map = json.load(f)["weight_map"]
    return {name: int(re.search(r"\d+", file).group(0)) for name, file in weight_map.items()}


def _as_sharded(full: torch.Tensor, like: DTensor) -> DTensor:
    """``full`` (the same on every rank) as a DTensor on ``like``'s mesh, sharded by rows; no
    communication, and no rank keeps more than its rows."""
    mesh = like.device_mesh
    sharded = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim, src_data_rank=None)
    return DTensor.from_local(
        sharded.to_local().clone(),
        mesh,
        sharded.placements,
        run_check=False,
        shape=sharded.shape,
        stride=sharded.stride(),
    )


class CanonStateDictAdapter(StateDictAdapter):
    """A family's Hugging Face format; subclasses give ``layout``, ``hf_model`` and
    ``hf_fields``."""

    def __init__(
        self, model_config, hf_assets_path: str | None = None, *, rope_layout: str = "lingua"
    ):
        self.model_config = model_config
        self.args = model_config.args
        self.hf_assets_path = hf_assets_path
        self.fqn_to_index_mapping = _index_mapping(hf_assets_path)
        self.rope_layout = rope_layout
        """'lingua' keeps LlamaCanon's q/k rows interleaved; 'huggingface' writes them
        rotate-half."""
        self._shapes: dict[str, torch.Size] | None = None

    # ------------------------------------------------------------------ what a family defines

    @abstractmethod
    def layout(self, names: Iterable[str]) -> dict[str, HFTensor]:
        """The Hugging Face tensors made of the canon-titan tensors ``names`` (a whole model, or one
        pipeline stage's part of it)."""

    @property
    @abstractmethod
    def hf_model(self) -> HFModel | None:
        """Our transformers classes for this model; None for transformers' own
        ``LlamaForCausalLM``."""

    @abstractmethod
    def hf_fields(self) -> dict:
        """The family's fields of ``config.json`` (the shape and maths of the model)."""

    def read_format(self, hf: dict, where: str) -> None:
        """Take the tensor layout of a Hugging Face folder whose ``config.json`` (``where``) is
        ``hf`` (its maths fields already checked)."""

    def config_class(self, hf: dict, where: str):
        """The transformers config class that reads ``hf``."""
        config_cls, _ = self.hf_model.classes()
        if hf.get("model_type") != config_cls.model_type:
            raise HFFormatError(
                f"{where}: model_type {hf.get('model_type')!r} is not {config_cls.model_type!r} "
                f"(the run's model is {self.args.label})"
            )
        return config_cls

    def compared(self, config_cls) -> list[str]:
        """Fields compared on import beyond those an export writes."""
        return []

    # ------------------------------------------------------------------ shapes

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Every canon-titan tensor of the model and its shape (the model built on the meta
        device)."""
        if self._shapes is None:
            with torch.device("meta"):
                model = self.model_config.build()
            self._shapes = {name: t.shape for name, t in model.state_dict().items()}
        return self._shapes

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every Hugging Face tensor of the whole model."""
        found = {}
        for hf_name, spec in self.layout(self.shapes).items():
            if spec.fixed is not None:
                found[hf_name] = tuple(spec.fixed.shape)
            else:
                rows = sum(self.shapes[s][0] for s in spec.sources)
                found[hf_name] = (rows, *self.shapes[spec.sources[0]][1:])
        return found

    def rows(self, spec: HFTensor) -> list[int]:
        return [self.shapes[s][0] for s in spec.sources]

    # ------------------------------------------------------------------ TorchTitan's protocol

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face names and layouts; tensors that are only renamed are passed on as they are
        (DTensor shards stay shards), joined or reordered ones are built whole and re-sharded."""
        out = {}
        for hf_name, spec in self.layout(state_dict).items():
            parts = [state_dict[s] for s in spec.sources]
            if spec.fixed is None and len(parts) == 1 and spec.order is None:
                out[hf_name] = parts[0]
            elif parts and isinstance(parts[0], DTensor):
                joined = spec.join([p.full_tensor() for p in parts])
                out[hf_name] = _as_sharded(joined, parts[0])
            else:
                out[hf_name] = spec.join(parts)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for hf_name, spec in self.layout(self.shapes).items():
            if spec.fixed is not None or hf_name not in hf_state_dict:
                continue
            tensor = hf_state_dict[hf_name]
            if len(spec.sources) == 1 and spec.order is None:
                out[spec.sources[0]] = tensor
            elif isinstance(tensor, DTensor):
                parts = spec.split(tensor.full_tensor(), self.rows(spec))
                out.update({s: _as_sharded(p, tensor) for s, p in zip(spec.sources, parts)})
            else:
                out.update(zip(spec.sources, spec.split(tensor, self.rows(spec))))
        return out

    # ------------------------------------------------------------------ config.json

    def hf_config(
        self, *, dtype: str = "fp32", max_seq_len: int = 0, tokenizer_ids: dict | None = None
    ) -> dict:
        ids = tokenizer_ids or {}
        common = {
            "vocab_size": self.args.vocab_size,
            "tie_word_embeddings": False,
            "bos_token_id": ids.get("bos_token_id"),
            "eos_token_id": ids.get("eos_token_id"),
            # transformers 5 reads "dtype", 4.x "torch_dtype".
            "dtype": DTYPE_NAMES[dtype],
            "torch_dtype": DTYPE_NAMES[dtype],
        }
        classes = self.hf_model
        if classes is None:
            return {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                **common,
                "max_position_embeddings": max_seq_len,
                **self.hf_fields(),
            }
        return {
            "architectures": [classes.architecture],
            "model_type": classes.classes()[0].model_type,
            "auto_map": classes.auto_map,
            **common,
            # For evaluation tools: the training sequence length (the linear models have no
            # positional limit).
            "max_position_embeddings": max_seq_len,
            **self.hf_fields(),
            **{
                field: getattr(self.args, field, default) for field, default in CANON_FIELDS.items()
            },
            **(
                {"canon_titan_note": CANON_BIAS_NOTE}
                if getattr(self.args, "canon_bias", False)
                else {}
            ),
        }

    def accept(self, hf: dict, where: str) -> None:
        """``hf`` (an HF folder's config.json) must describe the run's model: every field that
        changes the maths, as transformers resolves it (absent fields take the class's defaults),
        equals what an export of the run would write. Then the folder's tensor layout is taken."""
        config_cls = self.config_class(hf, where)
        found = _resolved(config_cls, hf, where)
        expected_fields = self.hf_config()
        expected = _resolved(config_cls, expected_fields, "the run config")
        keys = [k for k in expected_fields if k not in NOT_MATHS] + self.compared(config_cls)
        differ = []
        for key in dict.fromkeys(keys):
            got, want = self.field(found, key), self.field(expected, key)
            if key == "canon_set" and _letters(got) == _letters(want):
                continue
            if got != want:
                differ.append((key, got, want))
        if not differ:
            self.read_format(hf, where)
            return
        details = "; ".join(
            f"{key} is {got!r}, the run config expects {want!r}" for key, got, want in differ
        )
        canon = next(((got, want) for key, got, want in differ if key == "canon_set"), None)
        if canon is not None:  # another model, not another size: say that first
            raise HFFormatError(
                f"{where}: the folder holds a model with Canon layers "
                f"{canon[0] or 'none'}, the run's "
                f"{self.args.label} has {canon[1] or 'none'}: use the config of the model "
                "the folder "
                f"holds (its other differences: {details})"
            )
        raise HFFormatError(
            f"{where}: the folder holds another {self.args.label} than the run config's: {details}"
        )

    def field(self, config, key: str):
        """A resolved config's value of ``key``, as compared on import."""
        return getattr(config, key, None)

    def read_source(self, hf_dir: str) -> None:
        """``accept`` the ``config.json`` of the Hugging Face folder ``hf_dir``."""
        path = os.path.join(hf_dir, "config.json")
        try:
            with open(path) as f:
                hf = json.load(f)
        except OSError as e:
            raise HFFormatError(
                f"{path}: {e.strerror or e} (is {hf_dir} a Hugging Face model folder?)"
            ) from None
        except ValueError as e:
            raise HFFormatError(f"{path}: not readable JSON ({e})") from None
        if not isinstance(hf, dict):
            raise HFFormatError(f"{path}: not a JSON object")
        self.accept(hf, path)


def _letters(canon_set: str | None) -> set[str]:
    """The positions a canon_set enables ("bb", the release's spelling of b, counts as b)."""
    return set((canon_set or "").replace("bb", "b"))


def _resolved(config_cls, fields: dict, where: str):
    """The config as transformers reads it: the class's (the release's) defaults for absent
    fields."""
    try:
        return config_cls.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise HFFormatError(f"{where}: {e}") from None
