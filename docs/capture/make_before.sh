#!/bin/sh
# The capture loop and NLL of a3fe356 as the package before_a3fe356/ beside this file, for
# recording_host_cuts.py (from the repository root, in a git checkout). Not committed (.gitignore).
set -e
dir=docs/capture/before_a3fe356
mkdir -p "$dir"
: > "$dir/__init__.py"
git show a3fe356:traces/capture/nll.py > "$dir/nll.py"
git show a3fe356:traces/capture/capture.py | sed 's/^from traces.capture.nll import token_nll$/from before_a3fe356.nll import token_nll/' > "$dir/capture.py"
grep -q '^from before_a3fe356.nll import token_nll$' "$dir/capture.py"
