"""Evaluation helpers: test-set generators and prompt formats (lm-eval tasks live in eval/)."""
