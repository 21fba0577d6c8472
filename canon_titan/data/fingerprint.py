"""What a text loader reads, recorded in its checkpointed state so a resume on other data is caught.

A loader's position (a global sample counter, a stream's readers) only means something over the
same data: appended documents or re-tokenized shards change the windows and their shuffle, and a
resume would silently repeat some and skip others. The fingerprint names every input with what
identifies its contents cheaply: document files by size, token shards by their recorded token
count and checksum, Hub streams by name (all a stream offers)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

FINGERPRINT_KEY = "fingerprint"


def data_fingerprint(
    dataset: str, dataset_path: str | None, sources: list[str], held_out_fraction: float = 0.0
) -> str:
    """A JSON object: input name -> its description (a token shard that ``held_out_fraction``
    holds out for validation says so). Synthetic tasks (generated from the config, whose changes
    are reported with the config's) have none: ""."""
    from canon_titan.data.held_out import held_out_shards
    from canon_titan.data.inputs import resolve_paths
    from canon_titan.data.kinds import STREAM, SYNTHETIC
    from canon_titan.data.pretokenize import read_index

    if dataset in SYNTHETIC:
        return ""
    inputs: dict[str, str] = {}
    if dataset == "tokens":
        held_out = held_out_shards(dataset_path, held_out_fraction)
        for shard in read_index(dataset_path)["shards"]:
            name = str(Path(dataset_path) / shard["shard"])
            inputs[name] = f"{shard['tokens']} tokens, blake2b {shard['blake2b']}" + (
                ", held out for validation" if name in held_out else ""
            )
    elif dataset in STREAM:
        for source in sources:
            if source.startswith("hf:"):
                inputs[source] = "streamed from the Hugging Face Hub"
            for path in sorted(glob.glob(source)) if not source.startswith("hf:") else []:
                inputs[path] = f"{os.path.getsize(path)} bytes"
    else:
        for path in resolve_paths(dataset, dataset_path):
            inputs[path] = f"{os.path.getsize(path)} bytes"
    return json.dumps(inputs, sort_keys=True)


def fingerprint_changes(saved: str, current: str, shown: int = 3) -> str:
    """What differs between two fingerprints, in words ("" when nothing does)."""
    old, new = (json.loads(x) if x else {} for x in (saved, current))
    changes = (
        [f"{name} is new" for name in sorted(set(new) - set(old))]
        + [f"{name} is gone" for name in sorted(set(old) - set(new))]
        + [
            f"{name} changed ({old[name]} -> {new[name]})"
            for name in sorted(set(old) & set(new))
            if old[name] != new[name]
        ]
    )
    more = f" (and {len(changes) - shown} more)" if len(changes) > shown else ""
    return "; ".join(changes[:shown]) + more
