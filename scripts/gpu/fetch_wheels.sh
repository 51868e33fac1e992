#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what a GPU machine needs and cannot download: the wheels
# of scripts/gpu/wheels.txt for CPython 3.12 on manylinux x86-64, and SmolLM2's tokenizer
# files (benchmarks/benchmark_gpu.py puts them beside random weights). `make gpu-wheels`.
#   scripts/gpu/fetch_wheels.sh [PYTHON]    # PYTHON: the one with pip and this project
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-python3}
DEST=.whl
PLATFORMS=()
# pip matches a manylinux tag exactly: name every glibc level a wheel may be built for.
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17 2_12 2_5; do
    PLATFORMS+=(--platform "manylinux_${n}_x86_64")
done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two stop the install on the GPU machine
grep -v '^\s*\(#\|$\)' scripts/gpu/wheels.txt > "$DEST/requirements.txt"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" -r "$DEST/requirements.txt"

# The tokenizer: the embedded model's converted folder (converted once, ~40 s).
TOK=$("$PY" -c 'from vllm.config import DEFAULT_MODEL as M
from vllm.model_executor.model_loader import resolve_model; print(resolve_model(M))')
mkdir -p "$DEST/smollm2-tokenizer"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$TOK/$f" ]; then cp "$TOK/$f" "$DEST/smollm2-tokenizer/"; fi
done
echo "$(ls "$DEST"/*.whl | wc -l) wheels and the tokenizer in $DEST: $(du -sh "$DEST" | cut -f1)" \
    "(a device call carries at most 64 MiB with the project)"
