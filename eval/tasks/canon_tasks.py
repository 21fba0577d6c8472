"""Hooks the YAML tasks in this folder name with ``!function canon_tasks.NAME``.

lm-eval loads this file by path, so it only forwards to ``canon_titan.evaluation.lm_tasks``.
"""

from canon_titan.evaluation.lm_tasks import (
    babilong_prompt,
    babilong_results,
    local_jsonl,
    multihop_results,
)

__all__ = ["babilong_prompt", "babilong_results", "local_jsonl", "multihop_results"]
