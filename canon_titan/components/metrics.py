"""Reading a run's TensorBoard scalars back: ``python -m canon_titan.components.metrics
DUMP_FOLDER``."""

from __future__ import annotations

import argparse
import glob
import os
import sys

LOSS_TAG = "loss_metrics/global_avg_loss"
VALIDATION_TAG, PERPLEXITY_TAG = "validation/loss", "validation/perplexity"
"""What a validation logs (``components/validation.py``)."""


def read_all_scalars(dump_folder: str, tb_folder: str = "tb") -> dict[str, dict[int, float]]:
    """tag -> step -> value over every event file of the run (later files, e.g. of a resumed
    run, overwrite earlier values of the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    for path in sorted(
        glob.glob(
            os.path.join(dump_folder, tb_folder, "**", "events.out.tfevents.*"), recursive=True
        ),
        key=os.path.getmtime,
    ):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            series.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: dict(sorted(values.items())) for tag, values in series.items()}


def read_scalars(dump_folder: str, tag: str = LOSS_TAG, tb_folder: str = "tb") -> dict[int, float]:
    """step -> value for ``tag`` (empty if the run never logged it)."""
    return read_all_scalars(dump_folder, tb_folder).get(tag, {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise the training loss of a run.")
    parser.add_argument("dump_folder")
    parser.add_argument(
        "--require-decrease",
        action="store_true",
        help="exit 1 unless the last logged loss is below the first",
    )
    args = parser.parse_args(argv)
    losses = read_scalars(args.dump_folder)
    if not losses:
        print(f"no loss scalars under {args.dump_folder}/tb", file=sys.stderr)
        return 1
    steps = list(losses)
    print(
        f"loss: step {steps[0]} {losses[steps[0]]:.4f} -> step {steps[-1]} {losses[steps[-1]]:.4f} "
        f"({len(steps)} logged steps)"
    )
    if args.require_decrease and not losses[steps[-1]] < losses[steps[0]]:
        print("the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
