"""Evaluation: in-training evaluation, lm-eval runs, the synthetic tasks' scorers (``synthetic``),
test-set generators and prompt formats, and the comparison of runs (``report``); lm-eval task
definitions live in eval/."""
