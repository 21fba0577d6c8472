"""``canon-titan convert to-hf`` and ``from-hf``.

to-hf: DCP checkpoint (any parallel layout) -> sharded safetensors + index + config.json +
generation_config.json + tokenizer files. A ``llama`` model with full RoPE and no QK-norm (and no
Canon layer) becomes a standard ``LlamaForCausalLM``; anything else one of our classes
(``LlamaCanonForCausalLM``, ``GLACanonForCausalLM``, ``GatedDeltaNetCanonForCausalLM``,
``Mamba2CanonForCausalLM``) whose modeling code is written next to the weights (``auto_map``), so
transformers loads it with ``trust_remote_code=True`` without canon-titan installed.

from-hf: the reverse, giving a DCP folder to use as ``[checkpoint] initial_load_path``.

Both stream tensor by tensor, write into a temporary folder beside OUT_DIR and rename it at the
end: a failure leaves no OUT_DIR behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from torchtitan.tools.logging import logger

from canon_titan.convert.dcp_io import (
    ConversionError,
    check_against_model,
    find_step_dir,
    inner_failure,
    load_tensor,
    model_tensor_metadata,
    save_lazily,
)
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.hf import DTYPES
from canon_titan.models.common.state_dict_adapter import (
    CANON_BIAS_NOTE,
    CanonStateDictAdapter,
    HFFormatError,
    HFTensor,
)
from canon_titan.tools.processes import pid_alive

HF_MODELING_DIR = Path(__file__).resolve().parent.parent / "hf"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


OWNER_FILE = ".owner"
CHECKSUMS = "canon_titan_checksums.json"
"""BLAKE2b of every safetensors file of an export (safetensors itself has no checksum)."""


def _remove_stale_partials(out_dir: Path) -> None:
    """Temporary folders of earlier conversions into ``out_dir`` whose process is gone (killed
    before it could clean up): removed, and said so."""
    host = socket.gethostname()
    for partial in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        try:
            owner = json.loads((partial / OWNER_FILE).read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and owner.get("host") == host and pid_alive(owner.get("pid")):
            continue  # a conversion into the same folder is running now
        if owner is not None and owner.get("host") != host:
            logger.warning(
                f"{partial}: left by a conversion on {owner.get('host')}; remove it if "
                "that one is done"
            )
            continue
        shutil.rmtree(partial, ignore_errors=True)
        logger.info(f"removed {partial}, left by an interrupted conversion")


@contextmanager
def atomic_output_dir(out_dir: Path):
    """Yield a temporary folder beside ``out_dir``; rename it to ``out_dir`` on success. The folder
    has the user's usual permissions (umask), like any other output."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConversionError(f"output directory {out_dir} already exists and is not empty")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out_dir)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    except OSError as e:
        raise ConversionError(f"cannot write into {out_dir.parent}: {e.strerror or e}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        (tmp / OWNER_FILE).write_text(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        )
        yield tmp
        (tmp / OWNER_FILE).unlink()
        # Writers that use private modes (safetensors: 600) get the user's umask like any other
        # file.
        for root, dirs, names in os.walk(tmp):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o777 & ~umask)
            for name in names:
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


FULL_BELOW = 64 * 2**20
"""Free bytes under which a failed write's filesystem is called full."""


@contextmanager
def writing(out_dir: Path):
    """Any failure of the writes inside as one ConversionError naming ``out_dir`` and the free space
    of its filesystem: safetensors raises its own error (not an OSError) on a full disk, DCP's
    writer a CheckpointException (a BaseException) around the real one. A ConversionError raised by
    the tensors being written (a damaged input) stays what it is."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        reading = inner_failure(e, ConversionError)
        if reading is not None:
            raise reading from None
        free = shutil.disk_usage(out_dir.parent).free if out_dir.parent.is_dir() else None
        error = inner_failure(e, OSError)
        text = str(error or e).strip().splitlines()
        no_room = error is not None and error.errno == errno.ENOSPC
        full = no_room or (free is not None and free < FULL_BELOW)
        what = (
            "the disk is full"
            if full
            else f"{type(error or e).__name__}: {text[0] if text else ''}"
        )
        room = (
            f"{free / 2**20:,.1f} MiB free on its filesystem"
            if free is not None
            else "its filesystem unreadable"
        )
        again = ": free space and run the same command" if full else ""
        raise ConversionError(
            f"writing {out_dir} failed: {what} ({room}); nothing of it is left behind{again}"
        ) from e  # the cause kept for a traceback; the CLI prints one line


def file_checksum(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _verify_checksums(hf_dir: Path, files: Iterable[Path]) -> None:
    manifest = hf_dir / CHECKSUMS
    if not manifest.is_file():
        logger.info(
            f"{hf_dir} has no {CHECKSUMS} (not a canon-titan export): its files are read unverified"
        )
        return
    try:
        expected = json.loads(manifest.read_text())
    except ValueError as e:
        raise ConversionError(f"{manifest}: not readable JSON ({e})") from None
    for path in sorted(set(files)):
        if path.name in expected and file_checksum(path) != expected[path.name]:
            raise ConversionError(
                f"{path}: its contents changed since the export (checksum mismatch with "
                f"{CHECKSUMS})"
            )


def tokenizer_info(kind: str, path: str | None) -> tuple[list[Path], dict]:
    """A tokenizer's files to ship with an export, and its BOS/EOS ids (empty if it is absent)."""
    path = Path(path or ASSET_DIR)
    try:
        tok = build_tokenizer(kind, str(path))
    except (FileNotFoundError, OSError):
        return [], {}
    files = (
        [path] if path.is_file() else [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    )
    return files, {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}


def write_hf_files(
    folder: Path,
    adapter: CanonStateDictAdapter,
    *,
    dtype: str,
    max_seq_len: int,
    tokenizer: tuple[list[Path], dict],
) -> dict:
    """Everything of an export besides its weights, into ``folder``: config.json,
    generation_config.json, the modeling code, the tokenizer files, and the checksums of the
    safetensors files already there. Returns the config."""
    files, ids = tokenizer
    if getattr(adapter.args, "canon_bias", False):
        logger.warning(f"{folder}: {CANON_BIAS_NOTE} (also noted in its config.json)")
    config = adapter.hf_config(dtype=dtype, max_seq_len=max_seq_len, tokenizer_ids=ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("eos_token_id"),
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    classes = adapter.hf_model
    for name in classes.files if classes is not None else ():
        shutil.copy(HF_MODELING_DIR / name, folder / name)
    for path in files:
        shutil.copy(path, folder / path.name)
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        # The tokenizer's own file speaks for the corpus it was made with, not for this model: a
        # transformers pipeline truncates its inputs to this length.
        settings = json.loads(tokenizer_config.read_text())
        settings["model_max_length"] = max_seq_len
        tokenizer_config.write_text(json.dumps(settings, indent=2) + "\n")
    checksums = {p.name: file_checksum(p) for p in sorted(folder.glob("*.safetensors"))}
    (folder / CHECKSUMS).write_text(json.dumps(checksums, indent=2) + "\n")
    return config


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards, current, current_bytes = [], [], 0
    for name, size in sizes.items():
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    return shards + ([current] if current else [])


def hf_tensor(
    spec: HFTensor, read: Callable[[str], torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """One tensor of the HF model from canon-titan tensors that ``read(name)`` returns."""
    return spec.join([read(name) for name in spec.sources]).to(dtype).contiguous()


def hf_model_in_memory(
    adapter: CanonStateDictAdapter,
    read: Callable[[str], torch.Tensor],
    *,
    dtype: str,
    max_seq_len: int,
    tokenizer_ids: dict,
) -> torch.nn.Module:
    """The transformers model ``to-hf`` would export, built in memory from tensors that
    ``read(name)`` returns (a DCP checkpoint or live training weights), in eval mode."""
    from transformers.initialization import no_init_weights

    classes = adapter.hf_model
    config = adapter.hf_config(dtype=dtype, max_seq_len=max_seq_len, tokenizer_ids=tokenizer_ids)
    if classes is None:
        from transformers import LlamaConfig as config_cls
        from transformers import LlamaForCausalLM as model_cls
    else:
        config_cls, model_cls = classes.classes()
    with no_init_weights():
        model = model_cls(config_cls(**config))
    state = {
        hf_name: hf_tensor(spec, read, DTYPES[dtype])
        for hf_name, spec in adapter.layout(adapter.shapes).items()
    }
    model.load_state_dict(state, strict=True)
    return model.to(DTYPES[dtype]).eval()


def _checked_step(ckpt_dir, run, adapter: CanonStateDictAdapter):
    step_dir = find_step_dir(ckpt_dir)
    found = model_tensor_metadata(step_dir)
    check_against_model(
        {k: m.size for k, m in found.items()}, adapter.shapes, str(step_dir), run.label()
    )
    return step_dir, lambda name: load_tensor(step_dir, name, found[name])


def dcp_to_hf_model(ckpt_dir, run, dtype: str = "fp32") -> torch.nn.Module:
    """A DCP checkpoint of ``run``'s model as a transformers model, converted in memory."""
    adapter = run.state_dict_adapter()
    _, read = _checked_step(ckpt_dir, run, adapter)
    _, ids = tokenizer_info(run["tokenizer"]["kind"], run["tokenizer"]["path"])
    return hf_model_in_memory(
        adapter, read, dtype=dtype, max_seq_len=run["training"]["seq_len"], tokenizer_ids=ids
    )


def to_hf(
    ckpt_dir,
    out_dir,
    run,
    *,
    dtype: str = "fp32",
    rope_layout: str = "lingua",
    max_shard_size: int = 5 * 2**30,
) -> Path:
    from safetensors.torch import save_file

    start = time.perf_counter()
    adapter = run.state_dict_adapter(rope_layout=rope_layout)
    step_dir, read = _checked_step(ckpt_dir, run, adapter)
    layout = adapter.layout(adapter.shapes)
    shapes = adapter.hf_shapes()
    target = DTYPES[dtype]
    element = torch.empty((), dtype=target).element_size()
    sizes = {name: element * torch.Size(shape).numel() for name, shape in shapes.items()}
    shards = _plan_shards(sizes, max_shard_size)

    with writing(Path(out_dir)), atomic_output_dir(Path(out_dir)) as tmp:
        weight_map = {}
        for index, names in enumerate(shards, 1):
            filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            tensors = {name: hf_tensor(layout[name], read, target) for name in names}
            weight_map.update(dict.fromkeys(names, filename))
            save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
            del tensors
            logger.info(f"wrote {filename} ({len(names)} tensors)")
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
                indent=2,
            )
            + "\n"
        )
        config = write_hf_files(
            tmp,
            adapter,
            dtype=dtype,
            max_seq_len=run["training"]["seq_len"],
            tokenizer=tokenizer_info(run["tokenizer"]["kind"], run["tokenizer"]["path"]),
        )
    logger.info(
        f"Exported {step_dir} to {out_dir} as {config['architectures'][0]} "
        f"({len(layout)} tensors, {dtype}, {time.perf_counter() - start:.1f}s)"
    )
    return Path(out_dir)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ConversionError(f"{path}: not readable JSON ({e})") from None


def _read_hf_index(hf_dir: Path) -> dict[str, str]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index}: no weight_map")
        return weight_map
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise ConversionError(
            f"{hf_dir} has neither model.safetensors.index.json nor model.safetensors"
        )
    from safetensors import safe_open

    with _open_safetensors(single, safe_open) as f:
        return {name: single.name for name in f.keys()}


@contextmanager
def _open_safetensors(path: Path, safe_open):
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ConversionError(f"{path}: not a readable safetensors file ({e})") from e
    with handle as f:
        yield f


def checked_hf_folder(hf_dir: Path, run) -> tuple[CanonStateDictAdapter, dict[str, Path]]:
    """The adapter (fitted to the folder's config.json) and each HF tensor's file, after checking
    that every listed file is there, matches its recorded checksum, and every tensor has the shape
    the run's model expects."""
    from safetensors import safe_open

    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir} has no config.json (is it a Hugging Face model folder?)")
    adapter = run.state_dict_adapter()
    try:
        adapter.read_source(str(hf_dir))
    except HFFormatError as e:
        raise ConversionError(str(e)) from None
    files = {hf_name: hf_dir / filename for hf_name, filename in _read_hf_index(hf_dir).items()}
    missing = sorted({str(path) for path in files.values() if not path.is_file()})
    if missing:
        raise ConversionError(f"{missing[0]} is missing (listed in the index)")
    _verify_checksums(hf_dir, files.values())
    shapes = {}
    for hf_name, path in files.items():
        with _open_safetensors(path, safe_open) as f:
            shapes[hf_name] = tuple(f.get_slice(hf_name).get_shape())
    check_against_model(shapes, adapter.hf_shapes(), str(hf_dir), run.label())
    return adapter, files


def from_hf(hf_dir, out_dir, run) -> Path:
    from safetensors import safe_open

    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    adapter, files = checked_hf_folder(hf_dir, run)
    layout = adapter.layout(adapter.shapes)
    where = {source: (hf_name, spec) for hf_name, spec in layout.items() for source in spec.sources}

    def produce(name: str) -> torch.Tensor:
        hf_name, spec = where[name]
        with _open_safetensors(files[hf_name], safe_open) as f:
            try:
                tensor = f.get_tensor(hf_name)
            except Exception as e:
                raise ConversionError(
                    f"{files[hf_name]}: cannot read tensor {hf_name!r} ({e})"
                ) from e
        parts = dict(zip(spec.sources, spec.split(tensor, adapter.rows(spec))))
        return parts[name].to(torch.float32)

    with writing(Path(out_dir)), atomic_output_dir(Path(out_dir)) as tmp:
        save_lazily(
            tmp, {name: (shape, torch.float32) for name, shape in adapter.shapes.items()}, produce
        )
    logger.info(
        f"Imported {hf_dir} into DCP {out_dir} ({len(adapter.shapes)} tensors, "
        f"{time.perf_counter() - start:.1f}s)"
    )
    return Path(out_dir)
