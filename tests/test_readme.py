"""The README is true about the tree: every repository path it names exists, and every
``canon-titan`` command it shows names a real subcommand and only options that subcommand's
``--help`` lists (``--section.key`` overrides are the config's, checked by ``config validate``)."""

import re
import shutil

import pytest

from conftest import REPO

README = (REPO / "README.md").read_text()
TOP = ("canon_titan", "scripts", "train_configs", "tests", "docs", "eval", "model_registry", "synthetic_data", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*)" % "|".join(re.escape(t) for t in TOP))
TWO_LEVEL = {"config", "convert", "data", "eval"}
NOT_PATHS = {
    "eval/depo1/k", "eval/hellaswag/acc_norm",  # metric names in the logs, not files
    "train_configs/FILE.toml", "train_configs/my.toml",  # a placeholder, and an example error message's file
}


def named_paths(text: str) -> set[str]:
    """Repository paths in backticks, code blocks and links; patterns and placeholders are not paths."""
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
    # In code (a backtick, the venv's bin folder or the start of a code line before it), not in prose.
    for match in re.finditer(r"(?:(?<=`)|(?<=\.venv/bin/)|(?<=^)|(?<=^\$ ))canon-titan ([^`\n|]*)", joined, re.M):
        words = match.group(1).split()
        log_line = any(w.endswith(":") for w in words[:3])  # what a run prints, e.g. `canon-titan runtime shims: ...`
        if words and re.fullmatch(r"[a-z][a-z-]*", words[0]) and not log_line:
            out.append(words)
    return out


def test_every_path_the_readme_names_exists():
    assert len(named_paths(README)) > 50
    assert missing_paths(README, REPO) == []


def test_a_path_removed_from_the_tree_is_caught(tmp_path):
    """The check above fails when a named file goes: a copy of the tree without one of them."""
    paths = sorted(named_paths(README))
    for p in paths:
        source, target = REPO / p, tmp_path / p
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            target.mkdir(exist_ok=True)
        else:
            shutil.copy(source, target)
    assert missing_paths(README, tmp_path) == []
    removed = "scripts/benchmarks/plan_recipes.py"
    assert removed in paths
    (tmp_path / removed).unlink()
    assert missing_paths(README, tmp_path) == [removed]


def _help(argv: list[str], capsys) -> str:
    from canon_titan.cli import COMMANDS, main

    assert argv[0] in COMMANDS, f"README names `canon-titan {argv[0]}`; commands: {', '.join(COMMANDS)}"
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0, argv
    return capsys.readouterr().out


def test_every_canon_titan_command_in_the_readme_exists_with_its_options(capsys):
    found = commands(README)
    assert len(found) > 20
    helps: dict[tuple[str, ...], str] = {}
    for words in found:
        key = tuple(words[:2]) if words[0] in TWO_LEVEL and len(words) > 1 and not words[1].startswith("-") \
            else (words[0],)
        if key not in helps:
            helps[key] = _help(list(key), capsys)
        options = {w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)}
        unknown = sorted(o for o in options if o not in helps[key] and o != "--help")
        assert not unknown, f"`canon-titan {' '.join(words)}`: {unknown} not in `canon-titan {' '.join(key)} --help`"


def test_the_playground_figure_is_drawn_from_the_readme_tables(tmp_path):
    """``docs/accuracy.png`` is drawn from ``docs/playground_results.json``; every bar of it, with
    its 95% interval, is a cell of the README's playground tables."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("playground", REPO / "scripts" / "playground.py")
    playground = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(playground)
    results = json.loads((REPO / "docs" / "playground_results.json").read_text())
    text = README.replace("**", "")
    cells = [playground.cell(group) for task in results.values() for model in task.values()
             for group in model["groups"].values()]
    assert len(cells) == 16
    assert [c for c in cells if f"| {c} |" not in text] == []
    playground.plot(results, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000
