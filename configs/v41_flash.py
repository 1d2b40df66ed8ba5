"""DeepSeek-V4.1-Flash as released (docs/architecture.md section 2.1): the reference config.

    python -m deepseek41.tools.info --config=configs/v41_flash.py [--mesh=fsdp=64,expert=8]

The text backbone as released: 551,880,835,184 parameters plus 196,613,849,600 Engram table
parameters (tests/system/test_info.py pins both), single-pass mHC, CSA2 with the released cache
formats, Engram before layers 1 and 14. Training it needs a multi-host slice (fsdp and expert
sharding below). DeepSeek-ViT + aligner (485,273,600 parameters) is built with the released
dims; so is the DSpark drafter (14,225,362,530 parameters, trained after pretraining: stage 'off'
here), counted apart from the backbone by tools.info.
"""

from deepseek41.config import base_config


def get_config():
  c = base_config()
  m = c.model
  m.vocab_size = 129280
  m.d_model = 5120
  m.num_layers = 40
  m.num_encoder_layers = 20
  m.num_heads = 64
  m.head_dim = 512
  m.rope_head_dim = 64
  m.q_lora_rank = 1280
  m.o_groups = 8
  m.o_lora_rank = 1024
  m.sliding_window = 128
  m.compress_ratios = (0, 0) + (2,) * 18 + (1,) * 20
  m.kv_source_layer_ids = (2, 8, 14, 20)
  m.index_source_layer_ids = (2, 8, 14, 20, 24, 28, 32, 36)
  m.candidate_source_layer_id = 20
  m.engram_layer_ids = (1, 14)
  m.engram_max_ngram = 4
  m.engram_n_heads = 8
  m.engram_head_dim = 256
  m.engram_vocab_start = 16_000_000
  m.engram_pad_token_id = 2
  m.engram_compressed_vocab_size = 99_092
  m.engram_table_row_multiple = 4096  # the released row counts divide by 8 and 2 only
  m.residual = 'mhc_single_pass'
  m.hc_mult = 4
  m.hc_sinkhorn_iters = 20
  m.hc_eps = 1e-6
  m.attention_variant = 'csa2'
  m.kv_quant = 'fp4_e4m3_16'
  m.index_quant = 'fp4_ue8m0_32'
  m.swa_quant = 'fp8_ue8m0_32'
  m.index_n_heads = 32
  m.index_head_dim = 128
  m.index_topk = 512
  m.candidate_topk_blocks = 2048
  m.candidate_block_size = 8
  m.rope_theta = 10000.0
  m.compress_rope_theta = 160000.0
  m.yarn_factor = 16.0
  m.yarn_original_max_position = 65536
  m.rms_norm_eps = 1e-20
  m.n_routed_experts = 384
  m.num_experts_per_tok = 6
  m.n_shared_experts = 1
  m.moe_intermediate_size = 2304
  m.route_scale = 1.5
  m.swiglu_limit = 10.0
  m.router_bias_rate = 0.001
  m.init_std = 0.006

  # DeepSeek-ViT and the 3x3 merge aligner (vision_config, section 3.15).
  m.vision = True
  m.vision_layers = 32
  m.vision_dim = 1024
  m.vision_heads = 16
  m.vision_mlp = 2816
  m.vision_patch = 14
  m.vision_merge = 3
  m.vision_rope_theta = 10000.0
  m.vision_max_image_tokens = 1024
  m.vision_min_pixels = 295936
  m.image_token_id = 129264

  # The DSpark drafter as released (docs/architecture.md section 3.14); stage 'off' in pretraining.
  ds = c.dspark
  ds.num_blocks = 3                       # num_nextn_predict_layers
  ds.block_size = 5                       # dspark_block_size
  ds.target_layer_ids = (37, 38, 39)
  ds.markov_rank = 256
  ds.n_routed_experts = 128
  ds.num_experts_per_tok = 3
  ds.noise_token_id = 128799

  c.data.seq_len = 65536
  c.data.default_corpus_vocab_size = 16384
  c.train.batch_size = 64
  # [I] The release gives no rate. Under muon_hybrid (the default, the report's recipe) the 1B
  # model's best rate was 8x AdamW's (docs/performance.md sections 42, 51): sweep before a run.
  c.train.lr = 2.2e-4
  c.train.schedule = 'wsd'
  c.train.remat = 'block'
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.expert = 8
  c.checkpoint.max_to_keep = 2
  return c
