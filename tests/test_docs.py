"""The user's guide is true about the tree: README.md and every page under docs/. Every repository
path a page names exists, every ``canon-titan`` command it shows names a real subcommand and only
options that subcommand's ``--help`` lists (``--section.key`` overrides are the config's, checked by
``config validate``), every link between pages resolves to a file and, with an anchor, to one of its
headings; README.md stays a front page."""

import collections
import re
import shutil

import pytest

from conftest import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
TOPICS = [
    "configs",
    "models",
    "data",
    "launching",
    "parallelism",
    "checkpoints",
    "evaluation",
    "planning",
    "failures",
    "extending",
    "development",
    "experiments",
]
BENCHMARKS = ["gpu", "planner", "cpu", "sweeps"]
MAX_README_LINES = 400
TOP = (
    "canon_titan",
    "scripts",
    "train_configs",
    "tests",
    "docs",
    "eval",
    "model_registry",
    "synthetic_data",
    ".ci",
)
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*)" % "|".join(re.escape(t) for t in TOP))
TWO_LEVEL = {"config", "convert", "data", "eval"}
NOT_PATHS = {
    "eval/depo1/k",
    "eval/hellaswag/acc_norm",  # metric names in the logs, not files
    "train_configs/FILE.toml",
    "train_configs/my.toml",  # a placeholder, and an example error message's file
}
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST = re.compile(r"(?:tests/)?(test_\w+\.py)::(\w+)")


def named_paths(text: str) -> set[str]:
    """Repository paths in backticks, code blocks and links; patterns and placeholders are not
    paths."""
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,:;)")
        end = match.end(1)
        if end < len(text) and text[end] in "*{<":  # a glob or a placeholder follows
            continue
        found.add(path)
    return found - NOT_PATHS


def missing_paths(text: str, root) -> list[str]:
    return sorted(p for p in named_paths(text) if not (root / p).exists())


def commands(text: str) -> list[list[str]]:
    """Each ``canon-titan ...`` command line (continuations joined), as words."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    # In code (a backtick, the venv's bin folder or the start of a code line before it), not in
    # prose.
    for match in re.finditer(
        r"(?:(?<=`)|(?<=\.venv/bin/)|(?<=^)|(?<=^\$ ))canon-titan ([^`\n|]*)", joined, re.M
    ):
        words = match.group(1).split()
        log_line = any(
            w.endswith(":") for w in words[:3]
        )  # what a run prints, e.g. `canon-titan runtime shims: ...`
        if words and re.fullmatch(r"[a-z][a-z-]*", words[0]) and not log_line:
            out.append(words)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces as
    hyphens."""
    text = re.sub(
        r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower()
    )
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (outside code blocks), repeats numbered as GitHub numbers
    them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        base = slug(heading)
        out.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return out


def broken_links(page, root) -> list[str]:
    """Links of ``page`` (a path under ``root``) to files of the tree that do not exist, or to an
    anchor that is not one of the target page's headings."""
    text = page.read_text()
    out = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or root.resolve() not in file.parents and file != root.resolve():
            out.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            out.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_page_names_exists(page):
    assert missing_paths(page.read_text(), REPO) == []


def test_the_guide_names_paths():
    assert len(set().union(*(named_paths(p.read_text()) for p in PAGES))) > 80


def test_a_path_removed_from_the_tree_is_caught(tmp_path):
    """The check above fails when a named file goes: a copy of the tree without one of them."""
    text = "\n".join(p.read_text() for p in PAGES)
    paths = sorted(named_paths(text))
    for p in paths:
        source, target = REPO / p, tmp_path / p
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            target.mkdir(exist_ok=True)
        else:
            shutil.copy(source, target)
    assert missing_paths(text, tmp_path) == []
    removed = "scripts/benchmarks/plan_recipes.py"
    assert removed in paths
    (tmp_path / removed).unlink()
    assert missing_paths(text, tmp_path) == [removed]


def _help(argv: list[str], capsys) -> str:
    from canon_titan.cli import COMMANDS, main

    assert argv[0] in COMMANDS, (
        f"the guide names `canon-titan {argv[0]}`; commands: {', '.join(COMMANDS)}"
    )
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0, argv
    return capsys.readouterr().out


def test_every_canon_titan_command_in_the_guide_exists_with_its_options(capsys):
    found = [words for page in PAGES for words in commands(page.read_text())]
    assert len(found) > 20
    helps: dict[tuple[str, ...], str] = {}
    for words in found:
        key = (
            tuple(words[:2])
            if words[0] in TWO_LEVEL and len(words) > 1 and not words[1].startswith("-")
            else (words[0],)
        )
        if key not in helps:
            helps[key] = _help(list(key), capsys)
        options = {w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)}
        unknown = sorted(o for o in options if o not in helps[key] and o != "--help")
        assert not unknown, (
            f"`canon-titan {' '.join(words)}`: {unknown} not in `canon-titan "
            f"{' '.join(key)} --help`"
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_pages_resolves(page):
    assert broken_links(page, REPO) == []


def missing_tests(text: str, root) -> list[str]:
    """``test_file.py::test_name`` references (the fault table's) whose file has no such test."""
    return sorted(
        {
            f"{file}::{name}"
            for file, name in TEST.findall(text)
            if not (root / "tests" / file).is_file()
            or not re.search(rf"^(async )?def {name}\(", (root / "tests" / file).read_text(), re.M)
        }
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_page_names_exists(page):
    assert missing_tests(page.read_text(), REPO) == []


MAX_PAGE_BYTES = 100_000


def unreadable(text: str) -> list[str]:
    """What makes a page no guide: more than ``MAX_PAGE_BYTES``, or a line of prose (over 60
    characters, not a table row or a generated table's footnote) standing twice, as a paragraph
    pasted over and over does (f92c40a wrote one paragraph between every two characters of
    docs/planning.md: 8.4 MB)."""
    out = (
        [f"{len(text.encode()):,} bytes (at most {MAX_PAGE_BYTES:,})"]
        if len(text.encode()) > MAX_PAGE_BYTES
        else []
    )
    prose = [
        line
        for line in text.splitlines()
        if len(line) > 60 and not line.lstrip().startswith(("|", "_"))
    ]
    out += [f"twice: {line[:80]}" for line, n in collections.Counter(prose).items() if n > 1]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_page_is_a_readable_size_without_repeated_paragraphs(page):
    assert unreadable(page.read_text()) == []


def test_a_pasted_over_page_is_caught():
    paragraph = (
        "- **canon-titan's own GPU runs** (one H200): Llama-1B within 4% at the recipe's 8 x "
        "4096.\n"
    )
    assert unreadable("# Planning\n\n" + paragraph + "\n" + paragraph)[0].startswith(
        "twice: - **canon-titan's own"
    )
    pasted = paragraph.join("# Planning: how accurate it is")
    assert unreadable(pasted)[0].startswith("twice:") and unreadable("x" * 100_001)[0].startswith(
        "100,001 bytes"
    )


def test_a_renamed_test_is_caught(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_kept():\n    pass\n")
    text = "`test_a.py::test_kept`, `tests/test_a.py::test_renamed`, `test_b.py::test_kept`"
    assert missing_tests(text, tmp_path) == ["test_a.py::test_renamed", "test_b.py::test_kept"]


def test_a_broken_link_is_caught(tmp_path):
    """A link to a page that is not there, and one to a heading the page does not have."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Multi-node: `run_train.sh`\n\n```\n## not a heading\n```\n"
    )
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#multi-node-run_trainsh) [ok](docs/a.md#a-page) [ok](#front) "
        "[web](https://x.org/y)\n"
        "[gone](docs/b.md) [bad](docs/a.md#not-a-heading) [self](#nowhere)\n# Front\n"
    )
    assert broken_links(page, tmp_path) == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#not-a-heading (no such heading)",
        "README.md: #nowhere (no such heading)",
    ]


def test_the_readme_is_a_front_page():
    """At most 400 lines; the two set-up commands on its first screen; a link to every topic page
    and benchmark file, each of which exists."""
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES}"
    )
    first = "\n".join(lines[:15])
    assert "scripts/quickstart.sh" in first and "scripts/test.sh" in first
    links = set(LINK.findall(README.read_text()))
    for name in TOPICS:
        assert (REPO / "docs" / f"{name}.md").is_file() and f"docs/{name}.md" in links, name
    for name in BENCHMARKS:
        assert (
            REPO / "docs" / "benchmarks" / f"{name}.md"
        ).is_file() and f"docs/benchmarks/{name}.md" in links, name


def test_the_playground_figure_is_drawn_from_the_playground_tables(tmp_path):
    """``docs/accuracy.png`` is drawn from ``docs/playground_results.json`` (a sweep's results
    file); every bar of it, with its 95% interval, is a cell of the playground tables in
    docs/data.md, and the quick start's cells are the README's."""
    import json

    from canon_titan.sweep.plots import accuracy_figure
    from canon_titan.sweep.results import seed_cell
    from canon_titan.sweep.scores import SyntheticEval

    results = json.loads((REPO / "docs" / "playground_results.json").read_text())
    text = (REPO / "docs" / "data.md").read_text().replace("**", "")

    def cells(task):
        return [
            seed_cell(group, SyntheticEval(100))
            for arm in task["arms"].values()
            for seed in arm["seeds"].values()
            for group in seed["groups"].values()
        ]

    every = [c for task in results["tasks"].values() for c in cells(task)]
    assert len(every) == 16
    assert [c for c in every if f"| {c} |" not in text] == []
    readme = README.read_text().replace("**", "")
    quick = cells(results["tasks"]["Depo, 300 steps (quick start)"])
    assert quick and [c for c in quick if f"| {c} |" not in readme] == []
    accuracy_figure(results, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000


def test_the_readme_gpu_figures_are_measured_runs_of_record():
    """Every row of the README's GPU table is a run of ``canon_titan.plan.calibration.POINTS`` (the
    runs the planner is held to): its tokens/s, peak memory and date; and its ratio is its tokens/s
    over the Llama-1B run of the same shape and date."""
    from canon_titan.plan.calibration import POINTS

    text = README.read_text()
    table = text[text.index("**On a GPU**") : text.index("GDN2's only GPU figure")]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith(("| run", "|---"))
    ]
    assert len(rows) >= 4

    def number(cell):
        return float(re.match(r"[\d,.]+", cell.replace("**", "")).group(0).replace(",", ""))

    runs = {}
    for run, shape, tokens, ratio, memory, date in rows:
        batch, seq = (int(x.replace(",", "")) for x in shape.split(" x "))
        matches = [
            p
            for p in POINTS
            if p.date == date
            and p.measured_tokens_per_s == number(tokens)
            and p.measured_gib == number(memory)
        ]
        assert len(matches) == 1, (run, tokens, memory, date)
        point = matches[0]
        assert f"--training.local_batch_size {batch}" in " ".join(point.overrides), run
        assert f"--training.seq_len {seq}" in " ".join(point.overrides), run
        runs[(shape, date, run.split(",")[0])] = number(tokens)
        if ratio != "-":
            base = runs[(shape, date, "Llama-1B")]
            assert number(ratio.lstrip("x")) == pytest.approx(number(tokens) / base, abs=5e-4), run


def _same_run_of_llama(point):
    """The Llama-1B run of ``point``'s session, GPU and settings, its kernel choice aside (what its
    "x Llama-1B" is against)."""
    from canon_titan.plan.calibration import POINTS

    settings = tuple(o for o in point.overrides if o not in ("--model.kernel_backend", "torch"))
    return next(
        p
        for p in POINTS
        if p.kind.model == "llama"
        and (p.date, p.gpu, p.overrides) == (point.date, point.gpu, settings)
    )


def test_every_page_gives_gdn2_its_one_gpu_figure():
    """GDN2's only GPU runs are on its torch fallback (``POINTS``): every page that speaks of its
    GPU figure gives that run's ratio to the Llama-1B run of its session, and none says it has none
    (at 381a133 the README said so, models.md and gpu.md gave x0.216)."""
    from canon_titan.plan.calibration import POINTS

    runs = [p for p in POINTS if p.kind.model == "gdn2"]
    assert runs and all(p.kind.torch_kernels for p in runs)
    newest = max(runs, key=lambda p: p.date)
    llama = _same_run_of_llama(newest)
    ratio = f"x{newest.measured_tokens_per_s / llama.measured_tokens_per_s:.3f}"
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert not re.search(r"GDN2 ha(ve|s) no GPU figure|GLA5 and GDN2 have no", text), page
    for page in (README, REPO / "docs" / "models.md", REPO / "docs" / "benchmarks" / "gpu.md"):
        assert ratio in page.read_text(), (page, ratio)


def test_the_readme_says_which_gpus_have_no_figure_with_the_triton_canon_ops():
    """The README's GPU table is one H200's; for every other GPU of the runs of record without a
    LlamaCanon run on the Triton Canon ops (the H100's 2026-11-22 run had the torch backend), it
    says there is none."""
    from canon_titan.plan.calibration import POINTS, TRITON
    from canon_titan.plan.gpus import GPUS

    text = " ".join(README.read_text().split())
    triton = {
        p.gpu for p in POINTS if p.kind.model == "llama_canon" and set(TRITON) <= set(p.overrides)
    }
    for gpu in sorted({p.gpu for p in POINTS} - triton):
        assert f"no {GPUS[gpu].name.split()[0]} figure with the Triton Canon ops" in text, gpu


def _rendezvous(script: str) -> str:
    text = (REPO / "scripts" / script).read_text()
    backend = re.search(r"--rdzv_backend (\w+)", text)
    return backend.group(1) if backend else "static"


def test_the_pages_name_each_launch_scripts_rendezvous_as_it_is():
    """Every clause of a page that names a launch script and a rendezvous kind names the script's
    own (run_train.sh: torchrun's static one, which NODE_RANK orders; train.slurm: c10d). At
    381a133 parallelism.md gave both scripts a c10d rendezvous."""
    kinds = {script: _rendezvous(script) for script in ("run_train.sh", "train.slurm")}
    assert kinds == {"run_train.sh": "static", "train.slurm": "c10d"}
    checked = 0
    for page in PAGES:
        for clause in re.split(r"[.;|]\s|\n\n", page.read_text()):
            named = [script for script in kinds if script in clause]
            said = set(re.findall(r"\b(static|c10d)\b(?=[^.;|]*rendezvous)", clause))
            if named and said:
                checked += 1
                assert said == {kinds[s] for s in named}, (page.name, clause)
    assert checked >= 2


def test_no_page_says_importing_canon_titan_quiets_library_notes():
    """development.md: importing canon_titan changes nothing process-wide (its programs call
    ``process_setup``); so no snippet says ``import canon_titan`` quiets torchao (checkpoints.md's
    did), and a process that only imports it keeps torchao's logger unfiltered."""
    import subprocess
    import sys

    development = (REPO / "docs" / "development.md").read_text()
    assert "Importing `canon_titan` changes nothing process-wide" in development
    for page in PAGES:
        for line in page.read_text().splitlines():
            if re.match(r"\s*import canon_titan\b", line):
                assert "quiet" not in line.lower() and "drop" not in line.lower(), (page.name, line)
    script = "import canon_titan, logging; print(len(logging.getLogger('torchao').filters))"
    filters = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    ).stdout.split()
    assert filters == ["0"]


def test_the_resume_schedule_figures_are_torchtitans():
    """checkpoints.md's figures of a run resumed with a larger ``steps``: the learning rates
    TorchTitan's schedule gives the debug config's keys at 30 and at 60 steps (the cosine jumps;
    WSD stays at its peak through the stable phase)."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer

    from canon_titan.config import load

    run = load(REPO / "train_configs" / "llama_canon_debug.toml", [], environment=False)
    peak = run["optimizer"]["lr"]

    def lr(steps: int, at: int, **keys) -> float:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        schedule = LRSchedulersContainer.Config(**{**run["lr_scheduler"], **keys}).build(
            optimizers=[optimizer], training_steps=steps
        )
        for _ in range(at - 1):
            optimizer.step()
            schedule.step()
        return optimizer.param_groups[0]["lr"]

    text = " ".join((REPO / "docs" / "checkpoints.md").read_text().split())
    assert f"trains step 30 at {lr(30, 30):.2e}" in text
    assert f"step 31 trains at {lr(60, 31):.2e}" in text
    stable = [lr(steps, 21, decay_ratio=0.2) for steps in (30, 60)]
    assert stable == [peak, peak]
    assert f"{peak:g} at step 21 of the same config at 30 and at 60 steps" in text


def test_the_planning_pages_search_example_is_the_tables_search():
    """docs/planning.md's search example is written from its record by plan_search_recipes.py (so
    regenerating it fixes it), and that record is the search table's row of the same recipe and
    cluster (GPU-hours per 1T tokens there, of the run here); its ratio and saving are its
    figures'."""
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    path = REPO / "scripts" / "benchmarks" / "plan_search_recipes.py"
    spec = importlib.util.spec_from_file_location("plan_search_recipes", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = (REPO / "docs" / "planning.md").read_text()
    record = script.example_record_on_page(text)
    assert script.example_block(record) in text
    own, best = record["own"], record["best"]
    assert f"x{best['tokens_per_s'] / own['tokens_per_s']:.2f}" in script.example_prose(record)
    table = (REPO / "docs" / "benchmarks" / "planner.md").read_text()
    body = table.split(script.MARKERS[0], 1)[1].split(script.MARKERS[1], 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in body.splitlines()
        if line.startswith("| ") and not line.startswith(("| recipes", "|---"))
    ]
    cluster = f"{record['gpus']} x {record['gpu']}"
    row = next(r for r in rows if record["recipe"].rsplit("-lr", 1)[0] in r[0] and r[1] == cluster)
    assert (row[2], row[4]) == (own["layout"], best["layout"])
    from canon_titan.config import load

    config = load(REPO / "train_configs" / f"{record['recipe']}.toml", [], environment=False)
    run_tokens = config["training"]["steps"] * record["global_batch"] * record["seq_len"]
    for hours, cell in ((own["gpu_hours"], row[3]), (best["gpu_hours"], row[5])):
        assert hours * 1e12 / run_tokens == pytest.approx(float(cell.replace(",", "")), abs=1.5)
