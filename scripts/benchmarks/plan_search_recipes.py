"""``canon-titan plan --search`` over the release recipes: each recipe's own layout against the
fastest layout found that keeps its global batch, at the recipe's reference GPU count on H200 (the
release's GPU) and on one smaller cluster (64 H100s); GPU-hours per 1T tokens. Prints the table as
Markdown, or writes it into docs/benchmarks/planner.md between its markers (rows of recipes not searched this time
are kept).

    .venv/bin/python scripts/benchmarks/plan_search_recipes.py [--docs] [--only PATTERN] [--budget-s S] [--workers N] [--top K]
    .venv/bin/python scripts/benchmarks/plan_search_recipes.py --docs --refigure [--only PATTERN]

``--refigure`` plans the figures of the table's rows again with their layouts as found, without a
search (after a change to the planner's cost model; the layouts are not re-ranked).

Recipes that differ only in learning rate share a row. A recipe (its two clusters) takes 5-100
minutes on a 2-core CPU with one worker, by the model's size, the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime
import sys
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
HEADER = ["| recipes | cluster | recipe's layout | its GPU-hours (1T tokens) | best layout found | its GPU-hours "
          "(1T tokens) | saving | best with float8 (GPU-hours) |",
          "|---|---|---|---:|---|---:|---:|---|"]


def _per_trillion(outcome, tokens_per_step: int, gpus: int) -> float:
    return 1e12 / tokens_per_step * outcome.step_s * gpus / 3600


def rows(pattern: str | None, budget_s: float, workers: int | None = None, top: int = 3) -> list[str]:
    out = []
    for (model, size, reference), entries in recipes(pattern).items():
        config = str(entries[0][0])
        label = recipe_label(entries)
        for gpus, gpu in ((reference, "h200"), (64, "h100")):
            cluster = f"{gpus} x {GPUS[gpu].name}"
            print(f"[plan_search_recipes] {label} on {cluster}", file=sys.stderr, flush=True)
            found = search(config, [], gpus=gpus, gpu=GPUS[gpu], budget_s=budget_s, workers=workers, top=top,
                           pipelines=False, progress=progress_printer())
            tokens = found.global_batch * found.seq_len
            if found.recipe is not None and found.recipe.fits:
                own, own_hours = found.recipe.layout.describe(found.global_batch), _per_trillion(found.recipe, tokens, gpus)
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
            f8 = (f"{found.float8[0].layout.describe(found.global_batch)} "
                  f"({_per_trillion(found.float8[0], tokens, gpus):,.0f})") if found.float8 else "-"
            out.append(f"| {label} | {cluster} | {own} | {own_text} | {best_text} | {hours_text} | {saving} | {f8} |")
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
        label, cluster, own, _, best, _, _, float8 = [c.strip() for c in line.strip().strip("|").split("|")]
        if label not in by_label:
            continue
        config = str(by_label[label][0][0])
        count, name = cluster.split(" x ", 1)
        gpus, gpu = int(count), GPUS[gpu_keys[name]]
        recipe = load(config, [], environment=False)
        global_batch = recipe["training"]["global_batch_size"]
        tokens = global_batch * recipe["training"]["seq_len"]

        def hours(layout_text: str) -> float:
            result = plan(config, Layout.from_text(layout_text).overrides(global_batch), gpus=gpus, gpu=gpu,
                          advise=False)
            return 1e12 / tokens * result.step_s * gpus / 3600

        print(f"[plan_search_recipes] refiguring {label} on {cluster}", file=sys.stderr, flush=True)
        own_hours = hours(own) if own != "does not fit" else None
        best_hours = hours(best) if best != "none fits" else None
        saving = f"{100 * (1 - best_hours / own_hours):.0f}%" if own_hours and best_hours else "-"
        f8 = float8
        if float8 != "-":
            f8_layout = float8.rsplit(" (", 1)[0]
            f8 = f"{f8_layout} ({hours(f8_layout):,.0f})"
        out[(label, cluster)] = (f"| {label} | {cluster} | {own} | {f'{own_hours:,.0f}' if own_hours else '-'} | "
                                 f"{best} | {f'{best_hours:,.0f}' if best_hours else '-'} | {saving} | {f8} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", action="store_true", help="write the rows into docs/benchmarks/planner.md between the markers")
    parser.add_argument("--only", help="recipes whose name matches this glob")
    parser.add_argument("--budget-s", type=float, default=7200.0,
                        help="each search's budget (default 7200: a row is the whole search, its variants and "
                             "float8 included, however loaded the machine; pipeline layouts are probed only "
                             "where no other layout fits, as under plan --search's default budget)")
    parser.add_argument("--workers", type=int, help="planning processes per search (default: the search's own)")
    parser.add_argument("--top", type=int, default=3,
                        help="the search's --top: it plans the best 2 x top (at least 6) probed layouts in full (default 3)")
    parser.add_argument("--refigure", action="store_true",
                        help="with --docs: plan the figures of the table's rows again with their layouts as "
                             "found (no search); the stamp says which rows")
    args = parser.parse_args()
    if args.refigure:
        if not args.docs:
            parser.error("--refigure rewrites docs/benchmarks/planner.md's rows: give --docs too")
        page = REPO / "docs" / "benchmarks" / "planner.md"
        refigured = refigured_rows(page.read_text(), args.only)
        text = page.read_text()  # read again: another script may have written meanwhile
        _, body, _ = split_block(text, *MARKERS)
        lines = [line for line in body.splitlines() if line.startswith("| ")
                 and not line.startswith(("| recipes", "|---"))]
        keyed = {tuple(c.strip() for c in line.strip().strip("|").split("|")[:2]): line for line in lines}
        keyed.update(refigured)
        stamps = [line for line in body.splitlines() if line.startswith("_")]
        stamps.append(f"_Figures of the rows matching `{args.only or '*'}` planned again {datetime.date.today()} "
                      f"with their layouts as found (`--refigure`)._")
        write_atomic(page, replace_block(text, "search", HEADER + [keyed[k] for k in sorted(keyed)],
                                           markers=MARKERS, stamp="\n".join(stamps)))
        print(f"[plan_search_recipes] refigured {len(refigured)} rows in {page}", file=sys.stderr)
        return 0
    new = rows(args.only, args.budget_s, args.workers, args.top)
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
    write_atomic(page, replace_block(text, "search", HEADER + [kept[k] for k in sorted(kept)], markers=MARKERS,
                                       stamp=stamp))
    print(f"[plan_search_recipes] wrote {len(new)} rows into {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
