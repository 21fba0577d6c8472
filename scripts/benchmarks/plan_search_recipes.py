"""``canon-titan plan --search`` over the release recipes: each recipe's own layout against the
fastest layout found that keeps its global batch, at the recipe's reference GPU count on H200 (the
release's GPU) and on one smaller cluster (64 H100s); GPU-hours per 1T tokens. Prints the table as
Markdown, or writes it into docs/benchmarks/planner.md between its markers (rows of recipes not
searched this time are kept), and the search of ``EXAMPLE`` (docs/planning.md's example) into
docs/planning.md between its own.

    .venv/bin/python scripts/benchmarks/plan_search_recipes.py [--docs] [--only PATTERN]
        [--budget-s S] [--workers N] [--top K]
    .venv/bin/python scripts/benchmarks/plan_search_recipes.py --docs --refigure [--only PATTERN]
    .venv/bin/python scripts/benchmarks/plan_search_recipes.py --docs --example

``--refigure`` plans the figures of the table's rows (and of the example, when its recipe
matches) again with their layouts as found, without a search (after a change to the planner's
cost model; the layouts are not re-ranked). ``--example`` searches the example alone.

Recipes that differ only in learning rate share a row. A recipe (its two clusters) takes 5-100
minutes on a 2-core CPU with one worker, by the model's size, the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from canon_titan.plan.gpus import GPUS  # noqa: E402
from canon_titan.plan.planner import progress_printer  # noqa: E402
from canon_titan.plan.search import search  # noqa: E402
from canon_titan.tools.fileio import write_atomic  # noqa: E402
from plan_recipes import recipe_label, recipes, replace_block, split_block  # noqa: E402

MARKERS = ("<!-- plan:search -->", "<!-- /plan:search -->")
EXAMPLE = ("LlamaCanon-8B-Nemo-1T-lr0.003", 64, "h100")
"""docs/planning.md's search example: a recipe, the GPUs and their kind."""
EXAMPLE_MARKERS = ("<!-- plan:search-example -->", "<!-- /plan:search-example -->")
EXAMPLE_PAGE = REPO / "docs" / "planning.md"
HEADER = [
    "| recipes | cluster | recipe's layout | its GPU-hours (1T tokens) | best layout "
    "found | its GPU-hours "
    "(1T tokens) | saving | best with float8 (GPU-hours) |",
    "|---|---|---|---:|---|---:|---:|---|",
]


def _per_trillion(outcome, tokens_per_step: int, gpus: int) -> float:
    return 1e12 / tokens_per_step * outcome.step_s * gpus / 3600


def _outcome(layout: str, tokens_per_s: float, device_bytes: int, gpu_hours: float) -> dict:
    return {
        "layout": layout,
        "tokens_per_s": round(tokens_per_s),
        "gib": round(device_bytes / 2**30, 1),
        "gpu_hours": round(gpu_hours),
    }


def example_record(found, seconds: float, top: int) -> dict:
    """What docs/planning.md says of the example's search (``example_prose``)."""
    b, tried, own, best = found.global_batch, found.tried, found.recipe, found.ranked[0]
    return {
        "recipe": EXAMPLE[0],
        "gpus": found.gpus,
        "gpu": found.gpu_name,
        "global_batch": b,
        "seq_len": found.seq_len,
        "date": str(datetime.date.today()),
        "minutes": round(seconds / 60),
        "load": round(os.getloadavg()[0], 1),
        "budget_s": round(found.budget_s),
        "top": top,
        "structures": tried["structures"],
        "hsdp": tried["HSDP forms"],
        "probed": tried["probed"],
        "planned": tried["planned in full"],
        "fit": len(found.ranked),
        "refigured": None,
        "own": _outcome(
            own.layout.describe(b), own.tokens_per_s_per_gpu, own.device_bytes, own.gpu_hours
        ),
        "best": _outcome(
            best.layout.describe(b), best.tokens_per_s_per_gpu, best.device_bytes, best.gpu_hours
        ),
    }


def example_prose(record: dict) -> str:
    """The example's paragraph, from its record (which the page keeps beside it, for
    ``--refigure``)."""
    r, own, best = record, record["own"], record["best"]
    again = f"; the two layouts' figures planned again {r['refigured']}" if r["refigured"] else ""
    fit = f"{r['fit']} layout{'s' if r['fit'] != 1 else ''} that fit"
    text = (
        f"{r['recipe'].split('-Nemo')[0]} on {r['gpus']} {r['gpu'].split()[0]}s (its recipe "
        f"keeps {r['global_batch']:,} x {r['seq_len']:,} tokens per step), searched as the "
        "table of [benchmarks/planner.md](benchmarks/planner.md#the-release-recipes-searched) "
        f"searches it (`--budget-s {r['budget_s']} --top {r['top']}`; {r['date']}, "
        f"{r['minutes']} minutes on a 2-core machine at load {r['load']}{again}): "
        f"{r['structures']} factorizations ({r['hsdp']} of them also as HSDP), {r['probed']} "
        f"probes, {r['planned']} full plans, {fit}. The recipe's own layout, "
        f"`{own['layout']}`, plans at {own['tokens_per_s']:,} tokens/s per GPU and "
        f"{own['gib']} GiB; the best found, `{best['layout']}`, at "
        f"{best['tokens_per_s']:,} tokens/s and {best['gib']} GiB: "
        f"x{best['tokens_per_s'] / own['tokens_per_s']:.2f}, saving "
        f"{own['gpu_hours'] - best['gpu_hours']:,} of the run's {own['gpu_hours']:,} "
        "GPU-hours."
    )
    return textwrap.fill(text, 100, break_on_hyphens=False, break_long_words=False)


def example_block(record: dict) -> str:
    """The text between the example's markers: the paragraph and its record."""
    return f"{example_prose(record)}\n<!-- {json.dumps(record)} -->"


def example_record_on_page(text: str) -> dict:
    _, body, _ = split_block(text, *EXAMPLE_MARKERS)
    return json.loads(body.rsplit("<!-- ", 1)[1].rsplit(" -->", 1)[0])


def write_example(record: dict) -> None:
    text = EXAMPLE_PAGE.read_text()
    before, _, after = split_block(text, *EXAMPLE_MARKERS)
    write_atomic(
        EXAMPLE_PAGE,
        before
        + EXAMPLE_MARKERS[0]
        + "\n"
        + example_block(record)
        + "\n"
        + EXAMPLE_MARKERS[1]
        + after,
    )
    print(f"[plan_search_recipes] wrote the search example into {EXAMPLE_PAGE}", file=sys.stderr)


def refigured_example(record: dict) -> dict:
    """The example's two layouts planned again (no search)."""
    from canon_titan.plan.planner import plan
    from canon_titan.plan.search import Layout

    config = str(REPO / "train_configs" / f"{EXAMPLE[0]}.toml")
    out = dict(record, refigured=str(datetime.date.today()))
    for key in ("own", "best"):
        layout = record[key]["layout"]
        overrides = (
            [] if key == "own" else Layout.from_text(layout).overrides(record["global_batch"])
        )
        result = plan(config, overrides, gpus=EXAMPLE[1], gpu=GPUS[EXAMPLE[2]], advise=False)
        out[key] = _outcome(
            layout, result.tokens_per_s_per_gpu, result.worst.device_bytes, result.gpu_hours
        )
    return out


def _is_example(entries, gpus: int, gpu: str) -> bool:
    """Whether a row (its recipes, GPUs and GPU) is ``EXAMPLE``'s (the recipes that differ only in
    learning rate share a row, and plan alike)."""
    return any(path.stem == EXAMPLE[0] for path, _ in entries) and (gpus, gpu) == EXAMPLE[1:]


def rows(
    pattern: str | None,
    budget_s: float,
    workers: int | None = None,
    top: int = 3,
    examples: list | None = None,
    only_example: bool = False,
) -> list[str]:
    """The table's rows (``only_example``: the example's alone); the example's search, when it is
    one of them, appended to ``examples`` as its record."""
    out = []
    for (_model, _size, reference), entries in recipes(pattern).items():
        config = str(entries[0][0])
        label = recipe_label(entries)
        for gpus, gpu in ((reference, "h200"), (64, "h100")):
            if only_example and not _is_example(entries, gpus, gpu):
                continue
            cluster = f"{gpus} x {GPUS[gpu].name}"
            print(f"[plan_search_recipes] {label} on {cluster}", file=sys.stderr, flush=True)
            began = time.perf_counter()
            found = search(
                config,
                [],
                gpus=gpus,
                gpu=GPUS[gpu],
                budget_s=budget_s,
                workers=workers,
                top=top,
                pipelines=False,
                progress=progress_printer(),
            )
            if examples is not None and _is_example(entries, gpus, gpu) and found.ranked:
                examples.append(example_record(found, time.perf_counter() - began, top))
            tokens = found.global_batch * found.seq_len
            if found.recipe is not None and found.recipe.fits:
                own, own_hours = (
                    found.recipe.layout.describe(found.global_batch),
                    _per_trillion(found.recipe, tokens, gpus),
                )
                own_text = f"{own_hours:,.0f}"
            else:
                own, own_hours, own_text = "does not fit", None, "-"
            if found.ranked:
                best = found.ranked[0]
                hours = _per_trillion(best, tokens, gpus)
                saving = f"{100 * (1 - hours / own_hours):.0f}%" if own_hours else "-"
                best_text, hours_text = best.layout.describe(found.global_batch), f"{hours:,.0f}"
            else:
                best_text, hours_text, saving = "none fits", "-", "-"
            f8 = (
                (
                    f"{found.float8[0].layout.describe(found.global_batch)} "
                    f"({_per_trillion(found.float8[0], tokens, gpus):,.0f})"
                )
                if found.float8
                else "-"
            )
            out.append(
                f"| {label} | {cluster} | {own} | {own_text} | {best_text} | {hours_text} "
                f"| {saving} | {f8} |"
            )
    return out


def refigured_rows(text: str, pattern: str | None) -> dict[tuple[str, str], str]:
    """The table's rows whose recipe matches ``pattern``, their layouts kept as found and their
    figures planned again (after a change to the planner's cost model, without the hours a search
    takes; the ranking of the layouts is not redone)."""
    from canon_titan.config import load
    from canon_titan.plan.planner import plan
    from canon_titan.plan.search import Layout

    by_label = {recipe_label(entries): entries for entries in recipes(pattern).values()}
    gpu_keys = {gpu.name: key for key, gpu in GPUS.items()}
    _, body, _ = split_block(text, *MARKERS)
    out = {}
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith(("| recipes", "|---")):
            continue
        label, cluster, own, _, best, _, _, float8 = [
            c.strip() for c in line.strip().strip("|").split("|")
        ]
        if label not in by_label:
            continue
        config = str(by_label[label][0][0])
        count, name = cluster.split(" x ", 1)
        gpus, gpu = int(count), GPUS[gpu_keys[name]]
        recipe = load(config, [], environment=False)
        global_batch = recipe["training"]["global_batch_size"]
        tokens = global_batch * recipe["training"]["seq_len"]

        def hours(layout_text: str) -> float:
            result = plan(
                config,
                Layout.from_text(layout_text).overrides(global_batch),
                gpus=gpus,
                gpu=gpu,
                advise=False,
            )
            return 1e12 / tokens * result.step_s * gpus / 3600

        print(f"[plan_search_recipes] refiguring {label} on {cluster}", file=sys.stderr, flush=True)
        own_hours = hours(own) if own != "does not fit" else None
        best_hours = hours(best) if best != "none fits" else None
        saving = f"{100 * (1 - best_hours / own_hours):.0f}%" if own_hours and best_hours else "-"
        f8 = float8
        if float8 != "-":
            f8_layout = float8.rsplit(" (", 1)[0]
            f8 = f"{f8_layout} ({hours(f8_layout):,.0f})"
        out[(label, cluster)] = (
            f"| {label} | {cluster} | {own} | {f'{own_hours:,.0f}' if own_hours else '-'} | "
            f"{best} | {f'{best_hours:,.0f}' if best_hours else '-'} | {saving} | {f8} |"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help="write the rows into docs/benchmarks/planner.md between the markers",
    )
    parser.add_argument("--only", help="recipes whose name matches this glob")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=7200.0,
        help="each search's budget (default 7200: a row is the whole search, its variants and "
        "float8 included, however loaded the machine; pipeline layouts are probed only "
        "where no other layout fits, as under plan --search's default budget)",
    )
    parser.add_argument(
        "--workers", type=int, help="planning processes per search (default: the search's own)"
    )
    parser.add_argument(
        "--top",
        type=int,
        default=3,
        help="the search's --top: it plans the best 2 x top (at least 6) probed layouts in "
        "full (default 3)",
    )
    parser.add_argument(
        "--example",
        action="store_true",
        help="search docs/planning.md's example alone (its row of the table and its paragraph)",
    )
    parser.add_argument(
        "--refigure",
        action="store_true",
        help="with --docs: plan the figures of the table's rows again with their layouts as "
        "found (no search); the stamp says which rows",
    )
    args = parser.parse_args()
    if args.refigure:
        if not args.docs:
            parser.error("--refigure rewrites docs/benchmarks/planner.md's rows: give --docs too")
        page = REPO / "docs" / "benchmarks" / "planner.md"
        refigured = refigured_rows(page.read_text(), args.only)
        text = page.read_text()  # read again: another script may have written meanwhile
        _, body, _ = split_block(text, *MARKERS)
        lines = [
            line
            for line in body.splitlines()
            if line.startswith("| ") and not line.startswith(("| recipes", "|---"))
        ]
        keyed = {
            tuple(c.strip() for c in line.strip().strip("|").split("|")[:2]): line for line in lines
        }
        keyed.update(refigured)
        stamps = [line for line in body.splitlines() if line.startswith("_")]
        stamps.append(
            f"_Figures of the rows matching `{args.only or '*'}` planned again "
            f"{datetime.date.today()} "
            f"with their layouts as found (`--refigure`)._"
        )
        write_atomic(
            page,
            replace_block(
                text,
                "search",
                HEADER + [keyed[k] for k in sorted(keyed)],
                markers=MARKERS,
                stamp="\n".join(stamps),
            ),
        )
        print(f"[plan_search_recipes] refigured {len(refigured)} rows in {page}", file=sys.stderr)
        entries = next(e for e in recipes(None).values() if _is_example(e, *EXAMPLE[1:]))
        example_row = (recipe_label(entries), f"{EXAMPLE[1]} x {GPUS[EXAMPLE[2]].name}")
        if example_row in refigured:
            write_example(refigured_example(example_record_on_page(EXAMPLE_PAGE.read_text())))
        return 0
    examples: list[dict] = []
    new = rows(
        args.only, args.budget_s, args.workers, args.top, examples, only_example=args.example
    )
    if not args.docs:
        print("\n".join(HEADER + new))
        return 0
    page = REPO / "docs" / "benchmarks" / "planner.md"
    text = page.read_text()
    _, body, _ = split_block(text, *MARKERS)
    kept = {}
    for line in body.splitlines() + new:  # rows of recipes not searched this time stay
        if line.startswith("| ") and not line.startswith(("| recipes", "|---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            kept[(cells[0], cells[1])] = line
    stamp = f"_Searched {datetime.date.today()} with `scripts/benchmarks/plan_search_recipes.py`._"
    if args.only or args.example:  # the other rows keep their dates
        which = (
            f"The row of {EXAMPLE[0]} on {EXAMPLE[1]} x {GPUS[EXAMPLE[2]].name} "
            "(docs/planning.md's example)"
            if args.example
            else f"The rows matching `{args.only}`"
        )
        stamp = "\n".join(
            [line for line in body.splitlines() if line.startswith("_")]
            + [f"_{which} searched again {datetime.date.today()}._"]
        )
    write_atomic(
        page,
        replace_block(
            text, "search", HEADER + [kept[k] for k in sorted(kept)], markers=MARKERS, stamp=stamp
        ),
    )
    print(f"[plan_search_recipes] wrote {len(new)} rows into {page}", file=sys.stderr)
    for record in examples:
        write_example(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
