#!/usr/bin/env bash
# tests/services/test_worker_gpu.py on a node with 2 GPUs, under the node image's own python3 (torch with CUDA).
#
#   scripts/device_worker_gpu.sh prepare   here: fill .devsvc/ (git-ignored, ~32 MiB): wheels of what the GPU image
#                                          lacks, at the versions .venv has, for CPython 3.12; redis-server and the
#                                          shared libraries the image may lack
#   scripts/device_worker_gpu.sh           there (carry .devsvc): install the wheels into $DEVSVC_SITE, run the test,
#                                          write env.txt, pytest.log and every service's log under $OUT
#   scripts/device_worker_gpu.sh CMD ...   there: the same set-up, then CMD (e.g. python3 bench/serve_ttft.py ...)
#   DEVSVC_INSTALL_ONLY=1 ...              only install and import-check (what can be tried without a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
D=.devsvc
# the store, API, builder and worker import these; the GPU image has the rest (KINDS.md's list)
WHEELS="redis blake3 fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
typing_extensions annotated-doc python-multipart opentelemetry-api grpcio grpcio-health-checking grpcio-reflection
protobuf boto3 botocore s3transfer jmespath"

if [ "${1:-}" = prepare ]; then
    set -e
    grep -qx '/.devsvc/' .git/info/exclude || echo '/.devsvc/' >> .git/info/exclude
    rm -rf "$D" && mkdir -p "$D/whl" "$D/lib" "$D/bin" "$D/libexec"
    pins=$(for n in $WHEELS; do .venv/bin/python -m pip show "$n" | awk -v n="$n" '/^Version:/{print n"=="$2}'; done)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$D/whl" $pins
    cp "$(readlink -f "$(command -v redis-server)")" "$D/libexec/redis-server"     # it must be named redis-server
    for l in liblzf.so.1 libjemalloc.so.2 libsystemd.so.0 libatomic.so.1; do
        cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" "$D/lib/$l"
    done
    cat > "$D/bin/redis-server" <<'SH'
#!/bin/sh
# the carried redis-server with its carried libraries (for it only: python and torch keep the image's own)
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/../libexec/redis-server" "$@"
SH
    printf '#!/bin/sh\nexec bash "$(dirname "$0")/../scripts/device_worker_gpu.sh" "$@"\n' > "$D/run.sh"
    chmod +x "$D/bin/redis-server" "$D/run.sh"
    du -sh "$D"
    exit 0
fi

[ -d "$D/whl" ] || { echo "no $D/: run 'scripts/device_worker_gpu.sh prepare' here and carry .devsvc" >&2; exit 2; }
OUT=${OUT:-/tmp/out}
SITE=${DEVSVC_SITE:-/tmp/site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$D"/whl/*.whl || exit 3
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 PATH="$PWD/$D/bin:$PATH"
# NVLink multicast stays off (KINDS.md), in every process the test starts too (they inherit this environment)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c 'import redis, blake3, fastapi, uvicorn, pydantic, multipart, grpc_health, grpc_reflection, boto3, tokenizers
print("imports ok")' || exit 4
redis-server --version || exit 5
[ "${DEVSVC_INSTALL_ONLY:-}" = 1 ] && exit 0
if [ $# -gt 0 ]; then
    "$@"
    exit $?
fi
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"
rm -rf /tmp/rk-gpu
python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/rk-gpu tests/services/test_worker_gpu.py 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
find /tmp/rk-gpu -path '*/logs/*.log' -exec cp --parents {} "$OUT/" \; 2>/dev/null
exit "$rc"
