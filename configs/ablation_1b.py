"""~1.1B-parameter V4.1 ablation model (12 layers, 64 experts top-6) for one H200, at 64K tokens.

    python -m deepseek41.train --config=configs/ablation_1b.py --workdir=/tmp/ds41-1b

Same block structure as the released model at small scale: head_dim 512 with 64 RoPE dims and
one shared K=V latent, window 128, encoder layers 0-5 with a ratio-2 KV source (layer 2), decoder
layers 6-11 reading layer 6's ratio-1 KV (the candidate source) with Reindex layer 9, Engram ids
1 and 4. CSA2 is on with the released FP4/FP8 fake quantization: every ratio>0 layer attends to
its window plus the top-512 compressed entries its index source picks. One sequence of 65,536
tokens per step, bf16 compute with fp32 master weights. The default corpus is prepared with a
16K BPE vocabulary; pass --config.data.synthetic=True to measure the model without I/O, or
--config.data.seq_len=4096 --config.train.batch_size=16 for short-context ablations.
"""

from deepseek41.config import base_config


def get_config():
  c = base_config()
  m = c.model
  m.vocab_size = 16384
  m.d_model = 1024
  m.num_layers = 12
  m.num_encoder_layers = 6
  m.num_heads = 16
  m.head_dim = 512
  m.rope_head_dim = 64
  m.q_lora_rank = 512
  m.o_groups = 4
  m.o_lora_rank = 512
  m.sliding_window = 128
  m.compress_ratios = (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1)
  m.kv_source_layer_ids = (2, 6)
  m.index_source_layer_ids = (2, 6, 9)
  m.candidate_source_layer_id = 6
  m.engram_layer_ids = (1, 4)
  m.engram_max_ngram = 4             # 2-, 3-, 4-grams x 4 heads: 12 buckets of ~100K rows
  m.engram_n_heads = 4
  m.engram_head_dim = 64
  m.engram_vocab_start = 100_000     # 2 x 1.2M rows x 64 = 154M table parameters
  m.attention_variant = 'csa2'
  m.kv_quant = 'fp4_e4m3_16'
  m.index_quant = 'fp4_ue8m0_32'
  m.swa_quant = 'fp8_ue8m0_32'
  m.index_n_heads = 16
  m.index_head_dim = 128
  m.index_topk = 512
  m.candidate_topk_blocks = 256
  m.candidate_block_size = 8
  m.yarn_factor = 16.0
  m.yarn_original_max_position = 4096
  m.n_routed_experts = 64
  m.num_experts_per_tok = 6
  m.n_shared_experts = 1
  m.moe_intermediate_size = 384
  m.init_std = 0.006

  c.data.seq_len = 65536
  c.data.default_corpus_vocab_size = 16384
  c.data.num_workers = 2

  c.train.steps = 2000
  c.train.batch_size = 1
  # muon_hybrid's best of 1.2e-3 / 2.4e-3 / 4.8e-3 at 8 x 4,096 (AdamW's best: 3e-4, 2.96 against
  # 2.37 held-out after 600 steps; docs/performance.md sections 41, 42, 51).
  c.train.lr = 2.4e-3
  c.train.warmup_steps = 200
  c.train.schedule = 'wsd'
  c.train.eval_every_steps = 200
  c.train.eval_batches = 4
  # 64K tokens on one H200 (docs/performance.md section 23): block remat that keeps the
  # attention kernels' outputs, on layers 0-5 only (6-11 keep their residuals): 99 GB peak and
  # 3-8% faster than remat on every layer (remat_layers=0: 54 GB; remat='block': 33 GB, 7-8%
  # slower again). Layers 0-3 only measured the same speed at 101 GB. On an 80 GB GPU set
  # train.remat_layers=0.
  c.train.remat = 'block_keep_attention'
  c.train.remat_layers = 6

  c.checkpoint.every_steps = 500
  c.checkpoint.max_to_keep = 2      # 13 GB each (params + Adam moments in fp32)
  c.log.every_steps = 20
  return c
