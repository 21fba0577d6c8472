"""Which files a text dataset of a run reads (``[dataloader] dataset`` and ``dataset_path``)."""

from __future__ import annotations

from canon_titan.data.builtin import ASSET_DIR, CORPUS_FILE
from canon_titan.data.documents import DataError, expand_inputs, file_kind
from canon_titan.data.pretokenize import read_index


class DataConfigError(ValueError):
    pass


def resolve_paths(dataset: str, dataset_path: str | None) -> list[str]:
    if dataset == "builtin":
        return [str(ASSET_DIR / CORPUS_FILE)]
    if dataset in ("files", "tokens"):
        if not dataset_path:
            raise DataConfigError(
                f"dataloader.dataset_path is required when dataloader.dataset = {dataset!r}"
            )
        if dataset == "tokens":
            read_index(dataset_path)
            return [dataset_path]
        try:
            paths = expand_inputs(dataset_path)
        except DataError as e:
            raise DataConfigError(f"dataloader.dataset_path {e}") from None
        for path in paths:
            file_kind(path)
        return paths
    raise DataConfigError(
        f"unknown dataloader.dataset {dataset!r}; available: builtin, files, tokens"
    )
