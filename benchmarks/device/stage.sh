# Source from the repository root on a bare GPU machine (Python 3.12 with torch and CUDA, no
# network) to run the GPU benchmarks: unpacks a vLLM site tree and installs DeepSpeed from the
# kits carried beside the checkout, once per machine, then exports PYTHONPATH for the sources.
#   .stage/vllm-*-site-*.tar.xz   vLLM and its runtime dependencies as a site-packages tree
#   .whl/*.whl, .whl/deepspeed-*.tar.gz   DeepSpeed's sdist and its missing dependencies' wheels
# Usage: source benchmarks/device/stage.sh && python3 benchmarks/bench_capacity.py --largest ...
root=$PWD
if [ ! -f /tmp/site/.staged ]; then
  t0=$(date +%s)
  kit=$(ls .stage/vllm-*-site-*.tar.xz 2>/dev/null | head -1)
  [ -n "$kit" ] || { echo "stage.sh: no .stage/vllm-*-site-*.tar.xz beside the checkout"; return 1; }
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/site')" "$kit" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  mkdir -p /tmp/ds && tar xzf .whl/deepspeed-*.tar.gz -C /tmp/ds || return 1
  (cd /tmp/ds/deepspeed-*/ && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps \
    --no-build-isolation --target /tmp/site .) || return 1
  touch /tmp/site/.staged
  echo "stage.sh: staged in $(( $(date +%s) - t0 )) s"
fi
cd "$root" || return 1
# TORCH_CUDA_ARCH_LIST: DeepSpeed's op builder cannot parse an arch such as 9.0a.
export PYTHONPATH=/tmp/site:$(ls -d "$root"/packages/*/src | tr '\n' ':')$root/apps/cli/src \
  TORCH_CUDA_ARCH_LIST=9.0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
