"""TOML file + ``--section.key value`` overrides -> a validated run config -> ``Trainer.Config``.

Every problem is reported before any process group starts, as ``ConfigError`` whose message
names the file (or the command line), the ``[section] key`` and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import model_registry
from canon_titan.config.checks import check_run
from canon_titan.config.derive import derive
from canon_titan.config.run import ConfigError, RunConfig
from canon_titan.config.sections import SECTIONS, fields_of, section_schema
from canon_titan.tools.fileio import read_from

CLI = "command line"


# ----------------------------------------------------------------------------- types


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(names)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner)}"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


DTYPE_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""A dtype takes either spelling, in a TOML key and on the command line: the short names and
TorchTitan's long ones."""
_OTHER_DTYPE_SPELLING = {
    **DTYPE_SPELLINGS,
    **{long: short for short, long in DTYPE_SPELLINGS.items()},
}


def coerce(value, tp):
    """``value`` checked against the annotation ``tp`` (ints widen to floats); raises TypeError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        if _OTHER_DTYPE_SPELLING.get(value) in typing.get_args(
            tp
        ):  # "bf16" where TorchTitan says "bfloat16", ...
            return _OTHER_DTYPE_SPELLING[value]
        raise TypeError
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return coerce(value, arg)
            except TypeError:
                pass
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        (inner,) = typing.get_args(tp)
        return [coerce(v, inner) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


# ----------------------------------------------------------------------------- sources


def load_toml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "", f"config file not found{read_from(path)}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), "", f"not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            str(path),
            "",
            f"not UTF-8 (line {line}: byte {e.object[e.start : e.start + 1]!r}); "
            "TOML files must be UTF-8",
        ) from None
    except OSError as e:
        raise ConfigError(str(path), "", f"cannot be read ({e.strerror or e})") from None


class _Unset:
    """The value of ``--section.key unset``: the key as if the file did not set it."""

    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()


def _parse_value(text: str):
    if text == "unset":
        return UNSET
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(argv: list[str]) -> list[tuple[str, str, Any]]:
    """``--section.key value``, ``--section.key=value`` or a bare ``--section.flag`` (true).

    Values are read as TOML literals (``10``, ``true``, ``[0.9, 0.95]``, ``"x"``), falling back
    to a plain string, so ``--model.flavor 1B`` works without quotes. A bare ``unset`` (``UNSET``)
    drops the key the file set, which then takes its default; ``'"unset"'`` is the string.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(CLI, arg, "expected an override of the form --section.key value")
        name, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                text, i = argv[i + 1], i + 1
            else:
                text = "true"
        section, _, key = name.partition(".")
        if not section or not key or "." in key:
            raise ConfigError(CLI, arg, "expected an override of the form --section.key value")
        out.append((section, key, _parse_value(text)))
        i += 1
    return out


# ----------------------------------------------------------------------------- resolve


def _where(section: str, key: str) -> str:
    return f"[{section}] {key}"


def _check_sections(raw: dict, source: str) -> None:
    allowed = ", ".join(["model", *SECTIONS])
    for section, body in raw.items():
        if section != "model" and section not in SECTIONS:
            raise ConfigError(
                source, f"[{section}]", f"unknown section; allowed sections: {allowed}"
            )
        if not isinstance(body, dict):
            raise ConfigError(source, section, f"must be a table [{section}], not a value")


def _set_key(sections, origins, schema, section, key, value, source) -> None:
    if key not in schema:
        raise ConfigError(
            source, _where(section, key), f"unknown key; allowed keys: {', '.join(schema)}"
        )
    tp, default = schema[key]
    if value is UNSET:
        if default is dataclasses.MISSING:
            raise ConfigError(source, _where(section, key), "is required: it cannot be unset")
        sections[section][key] = default
        origins.pop((section, key), None)
        return
    try:
        sections[section][key] = coerce(value, tp)
    except TypeError:
        raise ConfigError(
            source, _where(section, key), f"expected {_type_name(tp)}, got {value!r}"
        ) from None
    origins[(section, key)] = source


def _model_schema(name: str, flavor: str, sources: dict[str, str]) -> tuple[Any, dict]:
    try:
        args_cls = model_registry.family(name).ARGS
    except model_registry.UnknownModelError as e:
        raise ConfigError(sources["name"], _where("model", "name"), str(e)) from None
    try:
        model_registry.model_args(name, flavor)
    except model_registry.UnknownModelError as e:
        raise ConfigError(sources["flavor"], _where("model", "flavor"), str(e)) from None
    schema = {"name": (str, name), "flavor": (str, flavor)}
    schema.update(fields_of(args_cls))
    return args_cls, schema


def resolve(
    path: str | os.PathLike,
    overrides: list[tuple[str, str, Any]] = (),
    environment: bool = True,
    weights_vocab: int | None = None,
) -> RunConfig:
    """``environment=False`` checks the config alone: not data paths, tokenizer files or the
    hardware (float8, CUDA kernels). A world size given in WORLD_SIZE is checked either way.
    ``weights_vocab``: see ``RunConfig.weights_vocab``."""
    source = str(path)
    raw = load_toml(path)
    _check_sections(raw, source)
    for section, key, _ in overrides:
        if section != "model" and section not in SECTIONS:
            raise ConfigError(
                CLI,
                f"--{section}.{key}",
                f"unknown section [{section}]; allowed sections: {', '.join(['model', *SECTIONS])}",
            )

    # [model] first: its name and flavor decide which keys the section has.
    model_raw = dict(raw.get("model", {}))
    model_sources = {k: source for k in model_raw}
    unset = []
    for section, key, value in overrides:
        if section == "model" and value is UNSET:
            if key in ("name", "flavor"):
                raise ConfigError(CLI, _where("model", key), "is required: it cannot be unset")
            model_raw.pop(key, None)  # the flavor's value
            model_sources.pop(key, None)
            unset.append(key)
        elif section == "model":
            model_raw[key], model_sources[key] = value, CLI
    for key in ("name", "flavor"):
        if key not in model_raw:
            raise ConfigError(source, _where("model", key), "required (a string)")
        if not isinstance(model_raw[key], str):
            raise ConfigError(
                model_sources[key],
                _where("model", key),
                f"expected a string, got {model_raw[key]!r}",
            )
    args_cls, model_schema = _model_schema(model_raw["name"], model_raw["flavor"], model_sources)
    for key in unset:
        if key not in model_schema:
            raise ConfigError(
                CLI, _where("model", key), f"unknown key; allowed keys: {', '.join(model_schema)}"
            )

    sections: dict[str, dict[str, Any]] = {
        "model": {"name": model_raw["name"], "flavor": model_raw["flavor"]}
    }
    origins: dict[tuple[str, str], str] = {}
    for key, value in model_raw.items():
        _set_key(sections, origins, model_schema, "model", key, value, model_sources[key])

    schemas = {name: section_schema(name) for name in SECTIONS}
    for name, schema in schemas.items():
        sections[name] = {k: d for k, (_, d) in schema.items() if d is not dataclasses.MISSING}
        for key, value in raw.get(name, {}).items():
            _set_key(sections, origins, schema, name, key, value, source)
    for section, key, value in overrides:
        if section != "model":
            _set_key(sections, origins, schemas[section], section, key, value, CLI)

    run = RunConfig(source=source, sections=sections, origins=origins, weights_vocab=weights_vocab)
    derive(run, environment)
    model = sections["model"]
    run.model_args = model_registry.model_args(
        model["name"],
        model["flavor"],
        {k: v for k, v in model.items() if k not in ("name", "flavor")},
    )
    # Show the flavor's full shape in the resolved config, not just the overridden keys.
    sections["model"] = {
        "name": model["name"],
        "flavor": model["flavor"],
        **dataclasses.asdict(run.model_args),
    }
    check_run(run, environment)
    return run


def load(
    path: str | os.PathLike,
    argv: list[str] = (),
    environment: bool = True,
    weights_vocab: int | None = None,
) -> RunConfig:
    return resolve(path, parse_overrides(list(argv)), environment, weights_vocab)
