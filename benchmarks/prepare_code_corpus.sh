#!/usr/bin/env bash
# A text set for the 1B optimizer comparison (issue 45) that does not repeat within a 600-step
# run: the default corpus is 2.65M training tokens, one pass every 81 steps at 8 x 4,096
# (docs/performance.md section 39), and 600 steps read 19.7M. This takes the Python sources of
# the project venv's site-packages (jax, flax, numpy, scipy, orbax, ...; tests and this package
# left out, and the table-like or vendored packages in SKIP), tokenized with the default corpus's
# 16K BPE so the 1B config's vocabulary and the held-out numbers stay comparable in kind:
# about 22M training tokens in ~45 MB of shards, small enough to carry to the GPU machine beside
# the wheels (64 MiB a call). Run here (the GPU machine has no network and no venv):
#   bash benchmarks/prepare_code_corpus.sh            # -> .corpus/code16k (git-ignored)
# then on the GPU: SOURCES=.corpus/code16k bash benchmarks/gpu_optimizer.sh ..., carry
# [".whl", ".corpus"].
set -euo pipefail
OUT_DIR=${OUT_DIR:-.corpus/code16k}
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SKIP=${SKIP:-"pip debugpy wcwidth fontTools pygments deepseek41"}
TOK=$(.venv/bin/python -c "from deepseek41.data.default_corpus import default_corpus_dir as d; \
print(d('', 16384, progress=False))")/tokenizer.json
STAGE=$(mktemp -d); trap 'rm -rf "$STAGE"' EXIT
prune=(); for p in $SKIP; do prune+=(-path "./$p" -prune -o); done
(cd "$SITE" && find . "${prune[@]}" \( -path "*/tests/*" -o -path "*/test/*" \) -prune -o \
  -name "*.py" -print0 | xargs -0 cp --parents -t "$STAGE")
rm -rf "$OUT_DIR"
.venv/bin/python -m deepseek41.data.prepare --input "$STAGE" --output "$OUT_DIR" \
  --tokenizer "$TOK" --extensions .py --no_progress
du -sh "$OUT_DIR"
