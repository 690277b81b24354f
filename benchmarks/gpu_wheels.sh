#!/usr/bin/env bash
# The Python packages benchmarks/gpu_suite.py needs on the GPU machine and that its image lacks, as wheels in .whl/
# (ignored by git), for CPython 3.12 on x86-64 Linux: DeepSpeed and the dependencies it lacks there (hjson, pydantic,
# pydantic-core, annotated-types, typing-inspection, and typing_extensions, which pydantic 2.14 needs at >= 4.16).
#
#   bash benchmarks/gpu_wheels.sh            # here, with network; PYTHON=... picks an interpreter with torch
#
# DeepSpeed publishes no binary wheel: it is built here from its source release with DS_BUILD_OPS=0, so the wheel is
# pure Python (py3-none-any, no compiled op); ops it needs at run time would JIT-build there, and gpu_suite.py runs
# none (torch's AdamW on both sides). Idempotent: what .whl/ already holds is kept; other versions of these packages
# are removed (two versions of one package stop the install there). Then the device command, one line, with carry
# [".whl"] and timeout_s 540 (docs/gpu.md, "How to run"):
#
# python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && python3 benchmarks/gpu_suite.py --out $OUT 2>&1 | tee $OUT/gpu_suite.log
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEEPSPEED=0.19.8
# name==version as pip spells it, and the file-name prefix of its wheel
PINNED=("hjson==3.1.0 hjson-3.1.0-" "pydantic==2.14.4 pydantic-2.14.4-" "pydantic_core==2.50.5 pydantic_core-2.50.5-"
        "annotated-types==0.8.0 annotated_types-0.8.0-" "typing-inspection==0.4.5 typing_inspection-0.4.5-"
        "typing_extensions==4.16.0 typing_extensions-4.16.0-")
DEVICE_COMMAND='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && python3 benchmarks/gpu_suite.py --out $OUT 2>&1 | tee $OUT/gpu_suite.log'

mkdir -p .whl
if ! git check-ignore -q .whl/probe.whl 2>/dev/null; then
    echo "/.whl/" >> "$(git rev-parse --git-path info/exclude)"  # the device tool carries it only when ignored
fi

keep_one() {  # remove other versions of a package: $1 the wheel-name stem ("pydantic_core"), $2 the kept prefix
    for f in .whl/"$1"-*.whl; do
        [ -e "$f" ] || continue
        case "$(basename "$f")" in "$2"*) ;; *) echo "removing $(basename "$f") (another version)"; rm -f "$f";; esac
    done
}

for entry in "${PINNED[@]}"; do
    spec=${entry% *}; prefix=${entry#* }
    keep_one "${prefix%%-*}" "$prefix"
    if ! ls .whl/"$prefix"*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
    fi
done

keep_one deepspeed "deepspeed-$DEEPSPEED-"
if ! ls .whl/deepspeed-"$DEEPSPEED"-*.whl >/dev/null 2>&1; then
    "$PYTHON" -c "import torch, setuptools" || { echo "PYTHON=$PYTHON needs torch and setuptools to build deepspeed"; exit 1; }
    # --no-cache-dir: pip's wheel cache may hold a deepspeed built with other DS_BUILD_* settings
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir "deepspeed==$DEEPSPEED" -w .whl
fi

# The DeepSpeed wheel must be pure Python: no compiled file, no op recorded as prebuilt.
wheel=$(ls .whl/deepspeed-"$DEEPSPEED"-*.whl)
case "$(basename "$wheel")" in *-py3-none-any.whl) ;; *) echo "$wheel is not a pure-Python wheel"; exit 1;; esac
"$PYTHON" - "$wheel" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    compiled = [n for n in z.namelist() if n.endswith((".so", ".pyd"))]
    info = z.read("deepspeed/git_version_info_installed.py").decode()
prebuilt = [name for name, built in re.findall(r"'(\w+)': (True|False)", info.split("installed_ops=")[1].split("\n")[0])
            if built == "True"]
if compiled or prebuilt:
    sys.exit(f"deepspeed wheel is not pure Python: compiled files {compiled}, prebuilt ops {prebuilt}")
print("deepspeed wheel: pure Python, no prebuilt op")
EOF

ls -l .whl
echo "total: $(du -cb .whl/*.whl | tail -1 | cut -f1) bytes in $(ls .whl/*.whl | wc -l) wheels"
echo "device command (carry [\".whl\"], timeout_s 540):"
echo "$DEVICE_COMMAND"
