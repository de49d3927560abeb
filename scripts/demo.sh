#!/usr/bin/env bash
# Demo of the strata CLI (placeholder: shows the command's help for now).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/strata --help
