#!/usr/bin/env bash
# examples/demo.sh: the `make demo` job. Prepares the fortunes corpus with
# zprep (once), then trains examples/demo.json under a local zcoord with two
# CPU zworkers (ZeRO stage 2, checkpoints every 100 steps) via ztrain.
set -euo pipefail
BUILD=${1:-build}
cd "$(dirname "$0")/.."
if ! ls examples/data/fortunes_train_*.bin >/dev/null 2>&1; then
  echo "demo: preparing examples/data from /usr/share/games/fortunes"
  "$BUILD/bin/zprep" $(ls /usr/share/games/fortunes/* | grep -v -E '\.(dat|u8)$') \
    --doc-sep % -o examples/data --prefix fortunes
fi
rm -rf "$BUILD/demo-run"
echo "demo: zcoord + 2 zworkers training examples/demo.json (logs in $BUILD/demo-run/)"
"$BUILD/bin/ztrain" examples/demo.json --workers 2 --threads 1 --dir "$BUILD/demo-run"
echo "demo: done. Inspect the run: $BUILD/bin/zctl is for a live coordinator;"
echo "      the logbook and metrics stay in $BUILD/demo-run/zcoord.db (sqlite3)."

# A sample from the trained model: the job's last epoch (every completed
# job ends with its final step committed) read straight from disk, no
# coordinator needed. The demo model's context is 64 tokens.
EPOCH=$(ls -d "$BUILD"/demo-run/ckpt/job_1/step_* | sort | tail -1)
echo "demo: a sample from the model at $EPOCH:"
"$BUILD/bin/zctl" sample --dir "$EPOCH" --prompt "The " --tokens 50 --temperature 0.8 --seed 7
