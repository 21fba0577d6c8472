#!/usr/bin/env bash
# ruff's lint and format checks (configured in pyproject.toml), which CI runs before the tests:
#   scripts/lint.sh [PATH ...]        check: non-zero exit on a lint finding or an unformatted file
#   scripts/lint.sh --fix [PATH ...]  format and apply ruff's safe fixes, then say what is left
# Without paths, the whole repository. ruff comes with the dev extra (scripts/setup.sh dev).
set -uo pipefail
cd "$(dirname "$0")/.."
RUFF=${RUFF:-.venv/bin/ruff}
if [ "${1:-}" = "--fix" ]; then
  shift
  "$RUFF" check --fix --quiet "${@:-.}"
  "$RUFF" format "${@:-.}"
  exec "$RUFF" check "${@:-.}"
fi
status=0
"$RUFF" format --check "${@:-.}" || status=1
"$RUFF" check "${@:-.}" || status=1
exit $status
