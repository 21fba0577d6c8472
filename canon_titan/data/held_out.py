"""The held-out data a run validates on (``[validation]``), per dataset kind, and the shards of a
token folder that a held-out fraction keeps from training.

- ``tokens``: a held-out token folder (``dataset_path``), or ``held_out_fraction`` of the run's own
  shards, which training then skips;
- ``files``: a glob of held-out documents (``dataset_path``); ``stream``: held-out ``sources``;
- ``builtin``: the built-in corpus's held-out split (the stories its generator writes after the
  corpus's);
- the synthetic tasks: samples of the training distribution from another seed's stream (``seed``),
  with the loss on the tokens training puts in the loss.

Text is read in order, without shuffling: a validation reads the same windows every time.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from canon_titan.data.builtin import ASSET_DIR, HELD_OUT_FILE
from canon_titan.data.kinds import SYNTHETIC
from canon_titan.data.pretokenize import read_index
from canon_titan.data.token_store import TokenStore

SOURCE_KEYS = {
    "tokens": ("dataset_path", "held_out_fraction"),
    "files": ("dataset_path",),
    "builtin": (),
    "stream": ("sources", "seed"),
    **{name: ("seed",) for name in SYNTHETIC},
}
"""The ``[validation]`` keys that say where each dataset kind's held-out data is."""


def held_out_shards(folder: str | Path, fraction: float) -> list[str]:
    """The shard files of ``folder`` that ``fraction`` holds out: ``ceil(fraction * n)`` of its
    ``n`` non-empty shards, spread evenly over the folder's order (which follows its source files: a
    run of neighbours may be one crawl or one quality bucket)."""
    shards = [str(Path(folder) / s["shard"]) for s in read_index(folder)["shards"] if s["tokens"]]
    count = math.ceil(fraction * len(shards))
    return [shards[int((i + 0.5) * len(shards) / count)] for i in range(count)] if count else []


def shard_part(store: TokenStore, held_out: list[str], read_held_out: bool) -> TokenStore:
    """The shards of ``store`` named in ``held_out`` (``read_held_out``), or the others."""
    keep = [i for i, name in enumerate(store.names) if (name in held_out) == read_held_out]
    return TokenStore(
        [store.arrays[i] for i in keep],
        names=[store.names[i] for i in keep],
        vocab_size=store.vocab_size,
    )


def validation_loader(run):
    """The loader config of the held-out data of a resolved run with ``[validation]``."""
    from canon_titan.data.packed import PackedTextDataLoader
    from canon_titan.data.streaming import StreamingTextDataLoader
    from canon_titan.data.synthetic import loader_config

    section, data = run["validation"], run["dataloader"]
    dataset = data["dataset"]
    if dataset in SYNTHETIC:
        return dataclasses.replace(loader_config(run), seed=section["seed"], windows_per_step=0)
    text = {k: data[k] for k in ("text_key", "on_error", "add_bos", "add_eos", "document_masking")}
    if dataset == "stream":
        return StreamingTextDataLoader.Config(
            dataset="stream",
            sources=section["sources"],
            seed=section["seed"],
            shuffle_buffer=1,
            **text,
        )
    if dataset == "tokens" and section["held_out_fraction"]:
        where = {
            "dataset_path": data["dataset_path"],
            "held_out_fraction": section["held_out_fraction"],
            "read_held_out": True,
        }
    elif dataset == "builtin":
        where = {"dataset": "files", "dataset_path": str(ASSET_DIR / HELD_OUT_FILE)}
    else:
        where = {"dataset_path": section["dataset_path"]}
    return PackedTextDataLoader.Config(
        **{"dataset": dataset, **where}, shuffle=False, infinite=False, **text
    )
