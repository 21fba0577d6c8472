"""The house rules of ``canon_titan/``, read from its source: TorchTitan's components are extended
by subclassing and configuring, not by assigning over their methods; an exception is told apart by
its type, not its message; the package's folders import in one direction, down a fixed order of
layers. And the suite's isolation: a command run in-process leaves logging as it found it."""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "canon_titan"

LAYERS = [
    {"tools"},
    {"kernels"},
    {"hf", "data"},  # the loaders build the documents' boundaries in the kernels' layout
    {"models"},
    {"convert"},
    {"components"},
    {"evaluation"},
    {"trainer"},
    {"config"},  # config/build.py makes the trainer's config; config/checks.py asks lm-eval's tasks
    {"plan", "launch"},
    {"sweep"},  # a sweep's cells are planned (its budgets), launched and scored
    {"train", "cli", "__init__", "__main__"},
]
"""canon_titan's folders and root modules, lowest first: each imports only from layers below its own
(never from its own layer's other units), so no two of them import each other, however
indirectly."""


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


@functools.cache
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{node.lineno}"


def _unit(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(tree: ast.AST):
    """(node, unit) for each import of a canon_titan folder or root module, at any depth (a
    function's lazy import counts as much as a module's)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = (
                [f"{node.module}.{alias.name}" for alias in node.names]
                if node.module == "canon_titan"
                else [node.module]
            )
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "canon_titan" and len(parts) > 1:
                yield node, parts[1]


def test_each_folder_imports_only_from_the_layers_below_it():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    units = {_unit(path) for path in _sources()}
    assert units <= set(layer), f"place these in LAYERS: {sorted(units - set(layer))}"
    upward = sorted(
        f"{_where(path, node)}: {_unit(path)} imports {unit}"
        for path in _sources()
        for node, unit in _imported_units(_tree(path))
        if unit != _unit(path) and layer[unit] >= layer[_unit(path)]
    )
    assert not upward, "imports from the same or a higher layer:\n" + "\n".join(upward)


def _functions_and_saved_methods(scope: ast.AST) -> set[str]:
    """Names in ``scope`` bound to a function (a ``def``, a lambda, ``partial(...)``) or to an
    attribute read (a method kept to be put back)."""
    names = set()
    for node in ast.walk(scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not scope:
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(
            node.value, (ast.Lambda, ast.Attribute, ast.Call)
        ):
            value = node.value
            if isinstance(value, ast.Call) and not ast.unparse(value.func).endswith("partial"):
                continue
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


@functools.cache
def _method_names(package: Path) -> frozenset[str]:
    """Every name defined as a method by a class of ``package`` or of TorchTitan's trainer,
    components and protocols."""
    titan = Path(importlib.util.find_spec("torchtitan").origin).parent  # read, not imported
    names = set()
    for path in [
        *package.rglob("*.py"),
        titan / "trainer.py",
        *(titan / "components").rglob("*.py"),
        *(titan / "protocols").rglob("*.py"),
    ]:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                names.update(
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                )
    return frozenset(names)


def test_no_component_method_is_assigned_over():
    """No function is assigned over a method of another object (``self.optimizers.step =
    guarded_step``, ``trainer.forward_backward_step = ...``, or the same with ``setattr``): a
    component's behaviour is a subclass's or its config's. Assignments to a module's or class's
    names are the upstream patches, each pinned in tests/test_upstream.py and found by its own
    scan."""
    methods = _method_names(PACKAGE)
    found = []
    for path in _sources():
        tree = _tree(path)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = function.args
            parameters = {
                a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            }
            functions = _functions_and_saved_methods(function)

            def another_object(target: ast.AST) -> bool:
                if isinstance(target, ast.Name):  # a parameter: the caller's object
                    return target.id in parameters - {"self", "cls"}
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                return (
                    isinstance(root, ast.Name)
                    and root.id in parameters
                    and isinstance(target, ast.Attribute)
                )

            def function_value(value: ast.AST) -> bool:
                return (
                    isinstance(value, ast.Lambda)
                    or (isinstance(value, ast.Name) and value.id in functions)
                    or (isinstance(value, ast.Call) and ast.unparse(value.func).endswith("partial"))
                )

            for node in ast.walk(function):
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                    if isinstance(node.value, ast.Tuple):
                        pairs = [
                            (t, v)
                            for target in node.targets
                            if isinstance(target, ast.Tuple)
                            for t, v in zip(target.elts, node.value.elts)
                        ] or pairs
                    for target, value in pairs:
                        if (
                            isinstance(target, ast.Attribute)
                            and target.attr in methods
                            and another_object(target.value)
                            and function_value(value)
                        ):
                            found.append(f"{_where(path, node)}: {ast.unparse(node)}")
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr"
                    and len(node.args) == 3
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in methods
                    and another_object(node.args[0])
                    and function_value(node.args[2])
                ):
                    found.append(f"{_where(path, node)}: {ast.unparse(node)}")
    assert not found, "methods assigned over:\n" + "\n".join(found)


def _found_in(source: str, scan, tmp_path, monkeypatch) -> str:
    """What ``scan`` (a test above) reports on a package of one file, ``source``."""
    package = tmp_path / "canon_titan"
    package.mkdir()
    (package / "trainer.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    try:
        scan()
    except AssertionError as e:
        return str(e)
    return ""


def test_the_method_scan_finds_an_instance_patch(tmp_path, monkeypatch):
    """The scan above, on a file written as the trainer was at 381a133."""
    found = _found_in(
        "class CanonTrainer:\n"
        "    def __init__(self, config):\n"
        "        step = self.optimizers.step\n"
        "        def guarded_step(*args, **kwargs):\n"
        "            return step(*args, **kwargs)\n"
        "        self.optimizers.step = guarded_step\n"
        "        self.checkpointer.before_fallback = self._resume_from\n",
        test_no_component_method_is_assigned_over,
        tmp_path,
        monkeypatch,
    )
    assert "canon_titan/trainer.py:6: self.optimizers.step = guarded_step" in found, found
    assert "before_fallback" not in found  # a hook the checkpointer declares, not a method


MESSAGE_READS = {"str", "repr", "format"}
"""Calls that turn an exception into its message."""
TEXT_TESTS = {
    "startswith",
    "endswith",
    "find",
    "index",
    "count",
    "search",
    "match",
    "fullmatch",
    "findall",
}


def _reads_message(node: ast.AST, name: str) -> bool:
    """Whether ``node`` reads the message of the exception bound to ``name`` (``str(e)``,
    ``e.args``, ``f"{e}"``)."""
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Name)
            and inner.func.id in MESSAGE_READS
            and any(isinstance(a, ast.Name) and a.id == name for a in inner.args)
        ):
            return True
        if (
            isinstance(inner, ast.Attribute)
            and inner.attr in ("args", "msg", "message")
            and isinstance(inner.value, ast.Name)
            and inner.value.id == name
        ):
            return True
        if (
            isinstance(inner, ast.FormattedValue)
            and isinstance(inner.value, ast.Name)
            and inner.value.id == name
        ):
            return True
    return False


def test_no_exception_is_told_apart_by_its_message():
    """In an ``except ... as e`` block, no comparison, ``in`` test, string method or regular
    expression reads ``e``'s message: what to do is decided by its type (or a typed attribute such
    as ``errno``)."""
    found = []
    for path in _sources():
        for handler in ast.walk(_tree(path)):
            if not isinstance(handler, ast.ExceptHandler) or not handler.name:
                continue
            for node in ast.walk(handler):
                tested = []
                if isinstance(node, ast.Compare):
                    tested = [node.left, *node.comparators]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in TEXT_TESTS
                ):
                    tested = [node.func.value, *node.args]
                if any(_reads_message(t, handler.name) for t in tested):
                    found.append(f"{_where(path, node)}: {ast.unparse(node)}")
    assert not found, "exceptions told apart by their message:\n" + "\n".join(found)


def test_the_message_scan_finds_a_message_match(tmp_path, monkeypatch):
    """The scan above, on the non-finite-loss catch as it was at 381a133."""
    found = _found_in(
        "def train_step(self):\n"
        "    try:\n"
        "        self.queued_train_step()\n"
        "    except RuntimeError as e:\n"
        "        if not str(e).startswith('Loss is not finite'):\n"
        "            raise\n"
        "    except OSError as e:\n"
        "        if e.errno == 28:\n"
        "            raise\n",
        test_no_exception_is_told_apart_by_its_message,
        tmp_path,
        monkeypatch,
    )
    assert "trainer.py:5:" in found and "trainer.py:8:" not in found, found


def test_a_command_run_in_process_logs_to_the_stdout_of_the_moment(capsys):
    """``init_logging`` (every command that logs) writes to ``sys.stdout`` as it is when a line is
    logged: a stream replaced and closed after the command (pytest's capture, a notebook's cell)
    takes none of the later lines, and none is a logging error."""
    from canon_titan.tools.startup import init_logging

    stdout, captured = sys.stdout, io.StringIO()
    sys.stdout = captured
    try:
        init_logging()
        logging.getLogger().info("during the command")
    finally:
        sys.stdout = stdout
    captured.close()
    logging.getLogger().info("after the command")
    out, err = capsys.readouterr()
    assert "after the command" in out and "Logging error" not in err, (out, err)


def test_the_config_tests_pass_after_the_pretuning_command_in_one_worker():
    """The order that failed (2026-12-01 review, E7): ``test_config.py``'s launch refusals read the
    one line they log after the pretuning command ran in the same process. Here in one pytest
    process, in that order, as any worker of the suite may run them."""
    tests = [
        "tests/test_linear_tuning.py::test_the_pretuning_command_refuses_what_it_cannot_tune",
        "tests/test_config.py::test_canon_titan_train_refuses_them_before_it_launches_or_writes",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "4 passed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:]
    )
