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


def dumps(sections: dict[str, dict]) -> str:
    """``None`` has no TOML form: such keys are written as comments (``# key = unset``)."""
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        for key, value in body.items():
            lines.append(f"# {key} = unset" if value is None else f"{key} = {_value(value)}")
        lines.append("")
    return "\n".join(lines)
