#!/bin/bash
# Builds the git-ignored folder .gpu/ that the device runs carry (session 27, 2026-12-04): the wheels the
# H200 image lacks (hivemind and its needs, for Python 3.12), this project as a wheel, and the
# gutenberg-offline corpus compressed (62 MB of text -> 18 MB, so the tree stays under the 64 MiB a call
# may carry). Run from the repository root with the project's venv active:
#   bash docs/records/s27/device/prepare.sh && cp docs/records/s27/device/run[12].sh .gpu/
# then one device call: `export CALL_LIMIT_S=585 QUALITY_LIMIT_S=500; bash .gpu/run1.sh` (carry .gpu),
# and, if time is left, `bash .gpu/run2.sh SECONDS_LEFT`.
set -eu
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu/whl && mkdir -p .gpu/whl .gpu/data
W=$(mktemp -d)
# sdist-only packages, built here as pure-Python wheels
pip wheel -q --no-deps -w "$W" prefetch_generator==1.0.3 varint==1.0.2 morphys==1.0 python-baseconv==1.2.2
python3 -m pip download -q --find-links "$W" --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$W" \
  hivemind==1.1.12 multiaddr==0.2.0 pydantic==2.14.4 fastapi==0.165.0 uvicorn==0.55.0 httpx==0.29.0 \
  protobuf==7.36.2 cryptography==50.0.2
# what the image already has (torch and CUDA above all): not carried
(cd "$W" && rm -f torch-* nvidia_* triton-* cuda_* numpy-* scipy-* sympy-* mpmath-* networkx-* jinja2-* \
  markupsafe-* fsspec-* filelock-* setuptools-* grpcio-* grpcio_tools-* certifi-*)
cp "$W"/*.whl .gpu/whl/ && rm -rf "$W"
pip wheel -q --no-deps --no-build-isolation -w .gpu/whl . && rm -rf build
D=../shared/data/gutenberg
(cd "$D" && tar -cf - train.txt test.txt MANIFEST.tsv) | xz -6 -T2 > .gpu/data/gutenberg.tar.xz
du -sh .gpu
