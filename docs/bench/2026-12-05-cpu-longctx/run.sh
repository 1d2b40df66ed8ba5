# The long-context ablation at CPU scale (docs/performance.md section 43): from the repository
# root, 2-core CPU, about 10 minutes a variant.
mkdir -p /tmp/cpuexp
for v in dense csa2 window; do
PATH=.venv/bin:$PATH OUT=/tmp/cpuexp/out CONFIG=configs/tiny.py SOURCES=mqar:0.5,passkey:0.5 \
  SHORT_LEN=256 SHORT_BATCH=8 SHORT_TASK_LEN=128 SHORT_STEPS=200 SHORT_EVERY=100 SHORT_S=1200 \
  STEPS=100 LEN=256 BATCH=8 TRAIN_S=1200 WARMUP2=10 EXAMPLES=8 \
  TASK_FLAGS="--config.tasks.mqar_pairs=4 --config.tasks.mqar_queries=4 --config.tasks.mqar_key_letters=2 --config.tasks.mqar_value_digits=1 --config.tasks.passkey_digits=3 --config.train.optimizer=muon_hybrid --config.train.lr=1e-2" \
  EVAL_TASKS=mqar@128,mqar@256,mqar@512,passkey@128,passkey@256,passkey@512 \
  bash benchmarks/gpu_longctx.sh $v > /tmp/cpuexp/$v.txt 2>&1
done
.venv/bin/python benchmarks/summarize_longctx.py /tmp/cpuexp/out/longctx_{dense,csa2,window}.json \
  --plot=/tmp/cpuexp/out/longctx_cpu_tiny.png
# csa2_warm.json: the CSA2 variant with every entry selected in the short stage (the stage-2
# run and the evaluation were rerun by hand after the script was edited under it; the same
# flags): the loop above with v=csa2 and
#   SHORT_EXTRA="--config.model.index_topk=256 --config.model.candidate_topk_blocks=64"
