"""Writes the resolved config back as TOML (the standard library only reads TOML)."""

from __future__ import annotations

import json


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _line(key: str, value) -> str:
    return f"{key} = unset" if value is None else f"{key} = {_value(value)}"


def dumps(sections: dict[str, dict], comments: dict[str, tuple[str, dict]] | None = None) -> str:
    """``None`` has no TOML form: such keys are written as comments (``# key = unset``).
    ``comments``: per section, a heading and keys written as comments after the section's keys."""
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        for key, value in body.items():
            lines.append(f"# {_line(key, value)}" if value is None else _line(key, value))
        heading, commented = (comments or {}).get(name, ("", {}))
        if commented:
            lines.append(f"# {heading}")
            lines += [f"# {_line(key, value)}" for key, value in commented.items()]
        lines.append("")
    return "\n".join(lines)


def run_toml(run, sections: dict[str, dict] | None = None, *, record: bool = False) -> str:
    """``run`` as TOML that resolves to the same run. Every section has every key, but ``[model]``
    only those the file and the command line set: the flavor's shape (and the vocabulary the
    tokenizer or the task gives) follows as comments, so that a copy given another flavor builds
    that flavor, not this one's shape under its name. A field the flavor leaves to a rule
    (``unset_values``) is shown with its value. ``sections``: ``run.sections`` as they are to be
    written (absolute paths). ``record``: the run's own copy (``run_config.toml``), read later where
    the tokenizer's files may not be: the vocabulary is a key there."""
    sections = sections or run.sections
    model = sections["model"]
    keys = ("name", "flavor", "vocab_size") if record else ("name", "flavor")
    pinned = {k: v for k, v in model.items() if k in keys or ("model", k) in run.origins}
    rules = getattr(run.model_args, "unset_values", {})
    follows = {
        k: getattr(run.model_args, rules[k]) if v is None and k in rules else v
        for k, v in model.items()
        if k not in pinned
    }
    vocab = " (vocab_size from the tokenizer or task)" if "vocab_size" in follows else ""
    heading = f"from flavor {model['flavor']!r}{vocab}; set a key above to pin it:"
    return dumps({**sections, "model": pinned}, {"model": (heading, follows)})
