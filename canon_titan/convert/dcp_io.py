"""Reading and writing DCP checkpoints one tensor at a time, in a single process.

DCP stores every tensor by its global shape whatever the FSDP/TP/PP layout that saved it, so a
checkpoint of any layout reads the same way. Reading loads one tensor per call; writing hands DCP
placeholder tensors (right shape and dtype, no storage) and produces each real tensor only when
the writer asks for it, so peak memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

# Non-model entries TorchTitan saves next to the flattened model FQNs.
TRAINING_STATE_PREFIXES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


class ConversionError(ValueError):
    pass


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose bytes do not load, or whose values are not finite (one line)."""


def inner_failure(
    exc: BaseException, wanted: type[BaseException] | tuple[type[BaseException], ...]
) -> BaseException | None:
    """The first ``wanted`` under an error (DCP wraps each rank's in its CheckpointException's
    ``failures``, {rank: (exception, stack)}, and chains others)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, wanted):
            return exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for _, inner in sorted(failures.items()):
                inner = inner[0] if isinstance(inner, tuple) else inner
                found = inner_failure(inner, wanted) if isinstance(inner, BaseException) else None
                if found:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


class FileNamingReader(FileSystemReader):
    """torch's DCP reader, naming the data file whose bytes do not load (torch's own error, from
    unpickling a slice of it, names none)."""

    _reading: Path | None = None

    def _slice_file(self, file, sinfo):
        self._reading = Path(self.path) / sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            if inner_failure(e, (OSError, MemoryError, torch.OutOfMemoryError)) is not None:
                # the file system's or the machine's trouble (EIO, ESTALE, ...), not the
                # checkpoint's bytes
                raise
            lines = str(e).strip().splitlines()
            raise CheckpointDamaged(
                f"{self._reading or self.path}: its bytes do not load ({type(e).__name__}: "
                f"{lines[0] if lines else ''})"
            ) from None


def read_metadata(step_dir: Path):
    try:
        return FileSystemReader(str(step_dir)).read_metadata()
    except Exception as e:  # a truncated or overwritten pickle raises anything from EOFError on
        raise ConversionError(
            f"{Path(step_dir) / '.metadata'}: not a readable DCP metadata file "
            f"({type(e).__name__}: {e})"
        ) from None


def checkpoint_problem(step_dir: str | Path) -> str | None:
    """Why a DCP step folder cannot load (unreadable metadata, a data file missing or shorter than
    the metadata says), or None. Reads the metadata and file sizes only, not the data."""
    step_dir = Path(step_dir)
    try:
        metadata = read_metadata(step_dir)
    except ConversionError as e:
        return str(e)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        path = step_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} is truncated ({path.stat().st_size} of at least {size} bytes)"
    return None


def values_problem(step_dir: str | Path) -> str | None:
    """Why the non-tensor entries of a checkpoint (train state, data loader and scheduler state:
    small) do not load, naming the file, or None. The tensors' bytes are checked as a run loads
    them."""
    keys = [
        k
        for k, m in read_metadata(Path(step_dir)).state_dict_metadata.items()
        if isinstance(m, BytesStorageMetadata)
    ]
    if not keys:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: loading in a single process"
            dcp.load(
                dict.fromkeys(keys), storage_reader=FileNamingReader(str(step_dir)), no_dist=True
            )
    except BaseException as e:  # DCP's CheckpointException (a BaseException) holds the reader's
        damaged = inner_failure(e, CheckpointDamaged)
        if damaged is None:
            raise
        return str(damaged)
    return None


def step_dirs(folder: str | Path) -> list[tuple[int, Path]]:
    """The ``step-N`` folders holding a DCP metadata file, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        (
            (int(m.group(1)), p)
            for p in folder.iterdir()
            if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / ".metadata").is_file()
        ),
        reverse=True,
    )


class NoLoadableCheckpoint(ConversionError):
    pass


def hf_export_steps(folder: str | Path) -> list[int]:
    """Steps whose ``step-N`` folder holds a Hugging Face export (``[checkpoint]
    last_save_in_hf``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for p in folder.iterdir()
        if (m := re.fullmatch(r"step-(\d+)", p.name))
        and not (p / ".metadata").is_file()
        and (p / "model.safetensors.index.json").is_file()
    )


def model_only(step_dir: Path) -> bool:
    """A DCP checkpoint of the model alone (``last_save_model_only``), which cannot continue
    training."""
    return not any(
        k.startswith("train_state.") for k in read_metadata(step_dir).state_dict_metadata
    )


def model_only_steps(folder: str | Path) -> list[int]:
    """Steps above 0 (a seed checkpoint is model-only by design) whose intact checkpoint holds the
    model only."""
    return [
        step
        for step, path in step_dirs(folder)
        if step > 0 and not checkpoint_problem(path) and model_only(path)
    ]


def resume_step(folder: str | Path, load_step: int = -1) -> tuple[int, list[str]]:
    """The step a run resuming from ``folder`` should load: ``load_step`` if given (it must be
    intact), else the newest intact ``step-N`` (-1 when there is none at all, a fresh start), and
    one message per newer folder skipped because it cannot load or cannot continue training: a
    damaged checkpoint, a Hugging Face export or a model-only last save (weights only; TorchTitan
    would pick it and fail inside the load). Raises
    NoLoadableCheckpoint when step folders exist but none loads."""
    folder = Path(folder)
    exports = set(hf_export_steps(folder))
    candidates = sorted(
        [*step_dirs(folder), *((step, folder / f"step-{step}") for step in exports)], reverse=True
    )
    every = candidates
    if load_step != -1:
        available = sorted(step for step, _ in candidates)
        candidates = [(step, path) for step, path in candidates if step == load_step]
        if not candidates:
            steps = ", ".join(map(str, available)) if available else "none"
            raise NoLoadableCheckpoint(
                f"[checkpoint] load_step = {load_step}: {folder} has no complete "
                f"step-{load_step}; the steps it holds: {steps}"
            )
    listed = {step for step, _ in candidates}
    # A save interrupted before its .metadata was written (the last thing a save writes).
    incomplete = (
        []
        if load_step != -1 or not folder.is_dir()
        else sorted(
            (
                int(m.group(1))
                for p in folder.iterdir()
                if (m := re.fullmatch(r"step-(\d+)", p.name))
                and p.is_dir()
                and int(m.group(1)) not in listed
            ),
            reverse=True,
        )
    )
    unfinished = [
        f"step-{step} has no .metadata (its save did not finish) and is skipped"
        for step in incomplete
        if not candidates or step > candidates[0][0]
    ]
    skipped = []
    for step, path in candidates:
        if step in exports:
            skipped.append(
                f"step-{step} holds a Hugging Face export (weights only), not a checkpoint "
                "to resume "
                "from; start a run from it with [checkpoint] initial_load_path and "
                "initial_load_in_hf"
            )
            continue
        problem = checkpoint_problem(path)
        if problem is None and step > 0 and model_only(path):
            skipped.append(
                f"step-{step} holds the model only ([checkpoint] last_save_model_only = "
                "true), without "
                "the optimizer and data loader state training continues from; resuming "
                "from the newest "
                "full checkpoint before it (set last_save_model_only = false in a run you "
                "may extend)"
            )
            continue
        problem = problem or values_problem(path)
        if problem is None:
            return step, unfinished + skipped
        if load_step != -1:
            earlier = next(
                (
                    s
                    for s, p in every
                    if s < load_step
                    and s not in exports
                    and checkpoint_problem(p) is None
                    and values_problem(p) is None
                ),
                None,
            )
            works = (
                f"; the newest checkpoint before it that loads is step {earlier}: "
                f"--checkpoint.load_step {earlier}"
                if earlier is not None
                else "; there is no earlier one that loads"
            )
            raise NoLoadableCheckpoint(
                f"[checkpoint] load_step = {load_step}: checkpoint step {step} cannot be "
                f"loaded: {problem}{works}"
            )
        skipped.append(f"checkpoint step {step} cannot be loaded and is skipped: {problem}")
    if skipped:
        raise NoLoadableCheckpoint(
            f"no checkpoint in {folder} can be loaded: "
            + "; ".join(unfinished + skipped)
            + " (move them away to start fresh)"
        )
    return -1, unfinished


def find_step_dir(path: str | Path) -> Path:
    """A DCP step folder: ``path`` itself, or the newest complete ``step-N`` inside it; either must
    be intact (see ``checkpoint_problem``)."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"checkpoint directory {path} does not exist")
    if (path / ".metadata").is_file():
        step_dir = path
    else:
        steps = step_dirs(path)
        if not steps:
            raise ConversionError(
                f"{path} is not a DCP checkpoint (no .metadata) and has no complete step-N folder"
            )
        step_dir = steps[0][1]
    problem = checkpoint_problem(step_dir)
    if problem:
        older = [
            str(p)
            for _, p in step_dirs(step_dir.parent)
            if p != step_dir and not checkpoint_problem(p)
        ]
        hint = f"; the newest intact one is {older[0]}" if older else ""
        raise ConversionError(f"checkpoint {step_dir} cannot be read: {problem}{hint}")
    return step_dir


def model_tensor_metadata(step_dir: Path) -> dict[str, TensorStorageMetadata]:
    metadata = read_metadata(step_dir)
    return {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith(TRAINING_STATE_PREFIXES)
    }


def check_against_model(
    found: dict[str, tuple[int, ...]], expected: dict[str, torch.Size], where: str, what: str
) -> None:
    """Every expected tensor present with its shape, and nothing else: names the first problem."""
    for name, shape in expected.items():
        if name not in found:
            raise ConversionError(f"{where}: tensor {name!r} of the model in {what} is missing")
        if tuple(found[name]) != tuple(shape):
            raise ConversionError(
                f"{where}: tensor {name!r} has shape {tuple(found[name])}, "
                f"the model in {what} expects {tuple(shape)}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ConversionError(
            f"{where}: tensor {extra[0]!r} is not part of the model in {what} "
            f"({len(extra)} unexpected tensors): a different model or Canon set?"
        )


def model_mismatch(step_dir: str | Path, shapes: dict[str, torch.Size], what: str) -> str | None:
    """Why the model tensors a checkpoint's ``.metadata`` lists are not the ones of the model
    with ``shapes`` (another shape or family), or None. Reads the metadata only."""
    try:
        check_against_model(
            {k: m.size for k, m in model_tensor_metadata(Path(step_dir)).items()},
            shapes,
            str(step_dir),
            what,
        )
    except ConversionError as e:
        return str(e)
    return None


def load_tensor(step_dir: Path, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: loading in a single process"
            dcp.load({name: tensor}, checkpoint_id=str(step_dir))
    except Exception as e:  # DCP wraps the storage error (EOFError, OSError, ...) in its own
        raise ConversionError(
            f"{step_dir}: cannot read tensor {name!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return tensor


class _LazySavePlanner(DefaultSavePlanner):
    """Produces each tensor when the writer asks for it and frees the previous one.

    torch's FileSystemWriter keeps a reference to every tensor it wrote (for its safetensors
    format), which would hold the whole model. With ``per_thread_copy_ahead=0`` the writer asks
    for tensors strictly one after another, so when tensor n+1 is requested tensor n is on disk
    and its storage can be released.
    """

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self._produce = produce
        self._previous: torch.Tensor | None = None

    def resolve_data(self, write_item):
        self.release()
        self._previous = self._produce(write_item.index.fqn)
        return self._previous

    def release(self) -> None:
        if self._previous is not None:
            self._previous.untyped_storage().resize_(0)
            self._previous = None


def save_lazily(
    out_dir: Path,
    specs: dict[str, tuple[torch.Size, torch.dtype]],
    produce: Callable[[str], torch.Tensor],
) -> None:
    """Write a DCP checkpoint of ``specs`` whose tensors ``produce(name)`` creates on demand."""
    placeholders = {
        name: torch.empty((), dtype=dtype).expand(shape) for name, (shape, dtype) in specs.items()
    }

    def checked(name: str) -> torch.Tensor:
        tensor = produce(name)
        shape, dtype = specs[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ConversionError(
                f"tensor {name!r}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {tuple(shape)} {dtype}"
            )
        storage = tensor.untyped_storage()
        if (
            not tensor.is_contiguous()
            or storage.nbytes() != tensor.nbytes
            or not storage.resizable()
        ):
            tensor = (
                tensor.contiguous().clone()
            )  # a tensor that owns exactly its storage, freeable later
        return tensor

    planner = _LazySavePlanner(checked)
    writer = FileSystemWriter(str(out_dir), thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(placeholders, storage_writer=writer, planner=planner)
    planner.release()


def load_model(run, ckpt_dir) -> torch.nn.Module:
    """The run's model on CPU (fp32, eval mode) with the weights of a DCP checkpoint."""
    model = run.model_spec().model.build()
    model.init_states()
    step_dir = find_step_dir(ckpt_dir)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    check_against_model(
        {k: m.size for k, m in model_tensor_metadata(step_dir).items()},
        expected,
        str(step_dir),
        run.source,
    )
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(step_dir))
    model.load_state_dict(state)
    return model.eval()
