"""Configuration: ConfigDict schema -> validation -> frozen dataclasses -> layer-role table.

Config files under `configs/` start from `base_config()` and override what they need. The schema
here is the single list of keys: anything a config file or a `--config.a.b=c` override names that
is not in it is rejected with the key's full name. `resolve()` validates the whole config before
anything compiles and returns the frozen `RunConfig` that the rest of the package reads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections

from deepseek41.batch import max_span_positions

LAYOUT_VERSION = 1  # bump when the train-state pytree layout changes incompatibly


class ConfigError(ValueError):
  """A config value is unknown, out of range or inconsistent; the message names the key."""


def base_config() -> ml_collections.ConfigDict:
  """Every key with its default. Sections: model, data, train, mesh, checkpoint, log."""
  c = ml_collections.ConfigDict()

  # ---- model: ARCHITECTURE.md section 2 names in brackets --------------------------------
  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 512                 # [vocab_size] must cover the tokenizer's vocabulary
  m.d_model = 128                    # [hidden_size]
  m.num_layers = 4                   # [num_hidden_layers] backbone layers (no DSpark blocks)
  m.num_encoder_layers = 2           # CED split: layers [0, n) are the causal encoder
  m.num_heads = 4                    # [num_attention_heads]
  m.head_dim = 64                    # [head_dim] width of the shared K=V latent
  m.rope_head_dim = 16               # [qk_rope_head_dim] RoPE on the last channels
  m.q_lora_rank = 64                 # [q_lora_rank]
  m.o_groups = 2                     # [o_groups]
  m.o_lora_rank = 64                 # [o_lora_rank] per group
  m.sliding_window = 16              # [sliding_window] keys t-W < s <= t
  # Residual (section 3.2): mHC over hc_mult streams, V4.1 single-pass or V4 multi-pass order,
  # or a plain pre-norm residual (ablation).
  m.residual = 'mhc_single_pass'     # mhc_single_pass | mhc_multi_pass | plain
  m.hc_mult = 4                      # [hc_mult] residual streams
  m.hc_sinkhorn_iters = 20           # [hc_sinkhorn_iters]
  m.hc_eps = 1e-6                    # [hc_eps]
  m.hc_init_std = 0.02               # std of the coefficient projections [S: HF's init]
  m.q_head_norm = True               # per-head q re-normalisation (section 3.3); off = HF parity
  # Layer roles (section 1). One ratio per backbone layer: 0 = SWA only, 1 or 2 = CSA2 ratio.
  m.compress_ratios = (0, 2, 1, 1)
  m.kv_source_layer_ids = (1, 2)
  m.index_source_layer_ids = (1, 2, 3)
  m.candidate_source_layer_id = 2    # -1: no candidate pool
  m.engram_layer_ids = (1,)
  # Engram (section 3.12): hashed n-gram memory injected into the residual before these layers.
  m.engram = True                    # off = the layer ids are ignored (ablation)
  m.engram_max_ngram = 3             # [engram_max_ngram_size]: 2..max-grams (released 4)
  m.engram_n_heads = 2               # [engram_n_heads] (released 8)
  m.engram_head_dim = 16             # [engram_head_dim] (released 256)
  m.engram_vocab_start = 1000        # [engram_vocab_size]: prime search start (released 16M)
  m.engram_pad_token_id = 2          # [engram_pad_token_id], in the hashed id space
  m.engram_compressed_vocab_size = 0  # [engram_compressed_vocab_size]; 0 = hash raw token ids
  m.engram_table_row_multiple = 1    # pad table rows to a multiple of this so they can shard
                                     # (a sum of primes divides by few mesh sizes); 1 = exact
  # CSA2 (sections 3.6-3.8): on in every shipped config; off = window attention only (ablation).
  m.csa2 = False
  m.index_n_heads = 4                # [index_n_heads]
  m.index_head_dim = 32              # [index_head_dim]
  m.index_topk = 8                   # [index_topk]
  m.indexer_loss_weight = 1.0        # weight of the indexer distillation loss [I] (model/csa2.py)
  m.candidate_topk_blocks = 4        # [candidate_topk_blocks]
  m.candidate_block_size = 4         # [candidate_block_size]
  m.index_topk_block = 8             # exact two-stage top-k over blocks of this size; 0 = one pass
  # RoPE (section 3.4): "main" for ratio-0 layers, "compress" (YaRN) for ratio > 0 layers.
  m.rope_theta = 10000.0
  m.compress_rope_theta = 160000.0
  m.yarn_factor = 4.0                # [rope_scaling.factor]; 1 disables YaRN
  m.yarn_original_max_position = 128
  m.yarn_beta_fast = 32.0
  m.yarn_beta_slow = 1.0
  m.rms_norm_eps = 1e-6              # released: 1e-20 (parity tests only)
  # DeepSeekMoE (section 3.11).
  m.n_routed_experts = 8
  m.num_experts_per_tok = 2
  m.n_shared_experts = 1
  m.moe_intermediate_size = 128
  m.route_scale = 1.5                # [routed_scaling_factor]
  m.swiglu_limit = 10.0
  m.router_bias_rate = 0.001         # gamma of the sign rule, per step, per modality
  m.balance_loss_weight = 1e-4       # alpha of the sequence-wise balance loss [S]; 0 disables
  m.moe_backend = 'auto'             # auto | reference | capacity_einsum | ragged_dot
  m.capacity_factor = 1.25           # capacity_einsum: slots per expert = ceil(cf * N * K / E)
  m.attention_impl = 'auto'          # auto | reference | chunked
  m.sparse_impl = 'auto'             # auto (= gathered) | reference | gathered
  m.sparse_chunk = 1024              # queries per chunk in the gathered path and the indexer
  m.index_impl = 'auto'              # auto (= fused on GPU where shapes allow) | reference | fused
  # Fake quantization (section 3.16), each 'none' or a deepseek41.quant format name; the
  # released formats are fp4_e4m3_16 / fp4_ue8m0_32 / fp8_ue8m0_32 (configs/v41_flash.py).
  m.kv_quant = 'none'                # compressed main KV, after RoPE
  m.index_quant = 'none'             # indexer q and k
  m.swa_quant = 'none'               # sliding-window KV, after RoPE
  m.init_std = 0.02
  m.compute_dtype = 'auto'           # auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  m.param_dtype = 'float32'          # master weights
  # Vision (section 3.15): DeepSeek-ViT + 3x3 merge aligner, image spans in the token stream.
  # Defaults are the tiny test dims; configs/v41_flash.py holds the released ones.
  m.vision = False
  m.vision_layers = 2                # released 32
  m.vision_dim = 64                  # 1024
  m.vision_heads = 4                 # 16 (head dim 64; 2D RoPE needs head dim % 4 == 0)
  m.vision_mlp = 128                 # SwiGLU hidden, 2816
  m.vision_patch = 4                 # patch side in pixels, 14
  m.vision_merge = 3                 # merge x merge patches -> one LM token
  m.vision_rope_theta = 10000.0
  m.vision_norm_eps = 1e-6
  m.vision_max_image_tokens = 16     # merged tokens per image at most, 1024 (~1344x1344 px)
  m.vision_min_pixels = 0            # images are scaled up to at least this area, 295936 (544^2)
  m.vision_attention_impl = 'auto'   # auto (= fused off the CPU) | reference | fused
  m.image_token_id = 0               # id placed at image-span positions (released 129264); its
                                     # table row is never read: spans take aligner outputs and
                                     # learned delimiters

  # ---- data -----------------------------------------------------------------------------
  d = c.data = ml_collections.ConfigDict()
  d.seq_len = 128
  # Comma-separated prepared dataset directories with optional mixture weights
  # ("/data/a:0.7,/data/b:0.3"). Empty: the embedded default corpus (Python stdlib sources).
  d.sources = ''
  d.synthetic = False                # random tokens, no I/O: for benchmarks
  d.cache_dir = ''                   # where the default corpus is prepared; '' = ~/.cache/deepseek41
  d.default_corpus_vocab_size = 512  # BPE vocabulary trained on the default corpus
  d.default_corpus_max_files = 0     # 0 = every stdlib source file
  d.shuffle_seed = 0
  d.num_workers = 0                  # grain worker processes (0 = in the training process)
  d.prefetch = 2                     # batches prefetched per worker / by the prefetch thread
  d.packing_bins = 16                # first-fit packing bins
  d.document_align = 2               # documents start at multiples of this (largest compress ratio)
  # Interleaved image-text sources (model.vision on), mixed with `sources` by weight:
  # "shapes:0.7,/data/pairs:0.2,/data/web.jsonl:0.1". `shapes` is the embedded task
  # (deepseek41/data/shapes.py); a directory holds image + caption pairs (a.png + a.txt); a
  # .jsonl file holds records {"content": [{"text": ...}, {"image": "relative/or/abs.png"}]}.
  d.image_sources = ''
  d.max_images_per_row = 4           # image slots per packed row (static shape)
  d.image_heldout_fraction = 0.02    # records of each image source held out for evaluation
  d.shapes_image_size = 48           # side in pixels of the embedded task's images

  # ---- train ----------------------------------------------------------------------------
  t = c.train = ml_collections.ConfigDict()
  t.steps = 200
  t.batch_size = 8                   # global batch (sequences per optimizer step)
  t.grad_accum_steps = 1             # microbatches per step; batch_size must divide evenly
  t.seed = 0
  t.lr = 3e-3
  t.min_lr_ratio = 0.1               # final lr = lr * min_lr_ratio
  t.warmup_steps = 20
  t.schedule = 'cosine'              # cosine | wsd | constant
  t.wsd_decay_fraction = 0.2         # wsd: the last fraction of steps decays linearly
  t.b1 = 0.9
  t.b2 = 0.95
  t.eps = 1e-8
  t.weight_decay = 0.1               # never on norms, biases, sinks or scales (1-D params)
  t.grad_clip_norm = 1.0             # global-norm clipping; 0 disables
  t.engram_table_lr_multiplier = 5.0  # Engram tables learn at this multiple of lr (section 4)
  # [I] The ViT and its aligner learn at this multiple of lr. Adam moves every aligner weight by
  # about lr per step, so its output (the LM input at image positions) grows like fan-in x lr
  # while a table embedding row barely moves; at a text-tuned lr the spans become large,
  # near-constant vectors the LM cannot read (docs/performance.md section 7.2).
  t.vision_lr_multiplier = 1.0
  t.remat = 'none'                   # none | block
  t.eval_every_steps = 50            # 0 disables evaluation
  t.eval_batches = 4
  t.peak_tflops = 0.0                # per-device peak for MFU; 0 = look up by device kind

  # ---- mesh -----------------------------------------------------------------------------
  mesh = c.mesh = ml_collections.ConfigDict()
  mesh.data = -1                     # -1: all devices left over by the other axes
  mesh.fsdp = 1
  mesh.expert = 1
  mesh.tensor = 1
  mesh.context = 1
  # logical axis -> mesh axis or axes ('' = replicated); see sharding.py
  mesh.rules = (
      ('batch', 'data,fsdp,expert'),
      ('length', 'context'),
      ('vocab', 'tensor'),
      ('embed', 'fsdp'),
      ('heads', 'tensor'),
      ('head_dim', ''),
      ('q_lora', ''),
      ('kv_latent', ''),
      ('o_groups', 'tensor'),
      ('o_lora', ''),
      ('mlp', 'tensor'),
      ('experts', 'expert'),
      ('expert_mlp', 'tensor'),
      ('index_heads', 'tensor'),
      ('index_dim', ''),
      ('norm', ''),
      ('hc_coef', ''),
      ('hc_embed', ''),
      ('engram_rows', 'fsdp,expert'),  # the tables are the largest tensors: shard their rows
      ('engram_dim', ''),
      ('engram_in', ''),
      ('vision_embed', ''),            # the ViT is small next to the LM: replicate its width
      ('vision_heads', 'tensor'),
      ('vision_mlp', 'tensor'),
      ('patch_in', ''),
      ('merge_in', ''),
  )

  # ---- checkpoint -----------------------------------------------------------------------
  ck = c.checkpoint = ml_collections.ConfigDict()
  ck.every_steps = 100               # 0 disables periodic saves (SIGTERM/SIGINT still save)
  ck.max_to_keep = 3                 # keep the newest N ...
  ck.keep_period = 0                 # ... plus every K-th step (0: none)
  ck.async_save = True

  # ---- log ------------------------------------------------------------------------------
  lg = c.log = ml_collections.ConfigDict()
  lg.every_steps = 10
  lg.tensorboard = True
  lg.progress_bar = True
  lg.profile_start_step = 0          # > 0: GPU/host trace of steps [N, N + profile_steps) (0: off)
  lg.profile_steps = 5
  return c


# ---------------------------------------------------------------------------------------------
# Frozen dataclasses: the only config objects model and training code see.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int
  num_layers: int
  num_encoder_layers: int
  num_heads: int
  head_dim: int
  rope_head_dim: int
  q_lora_rank: int
  o_groups: int
  o_lora_rank: int
  sliding_window: int
  q_head_norm: bool
  compress_ratios: tuple[int, ...]
  kv_source_layer_ids: tuple[int, ...]
  index_source_layer_ids: tuple[int, ...]
  candidate_source_layer_id: int
  engram_layer_ids: tuple[int, ...]
  engram: bool
  engram_max_ngram: int
  engram_n_heads: int
  engram_head_dim: int
  engram_vocab_start: int
  engram_pad_token_id: int
  engram_compressed_vocab_size: int
  engram_table_row_multiple: int
  csa2: bool
  residual: str
  hc_mult: int
  hc_sinkhorn_iters: int
  hc_eps: float
  hc_init_std: float
  index_n_heads: int
  index_head_dim: int
  index_topk: int
  indexer_loss_weight: float
  candidate_topk_blocks: int
  candidate_block_size: int
  index_topk_block: int
  rope_theta: float
  compress_rope_theta: float
  yarn_factor: float
  yarn_original_max_position: int
  yarn_beta_fast: float
  yarn_beta_slow: float
  rms_norm_eps: float
  n_routed_experts: int
  num_experts_per_tok: int
  n_shared_experts: int
  moe_intermediate_size: int
  route_scale: float
  swiglu_limit: float
  router_bias_rate: float
  balance_loss_weight: float
  moe_backend: str            # resolved: reference | capacity_einsum | ragged_dot
  capacity_factor: float
  attention_impl: str         # resolved: reference | chunked
  sparse_impl: str            # resolved: reference | gathered
  sparse_chunk: int
  index_impl: str             # resolved: reference | fused
  kv_quant: str
  index_quant: str
  swa_quant: str
  init_std: float
  compute_dtype: str          # resolved: float32 | bfloat16
  param_dtype: str
  vision: bool
  vision_layers: int
  vision_dim: int
  vision_heads: int
  vision_mlp: int
  vision_patch: int
  vision_merge: int
  vision_rope_theta: float
  vision_norm_eps: float
  vision_max_image_tokens: int
  vision_min_pixels: int
  vision_attention_impl: str  # resolved: reference | fused
  image_token_id: int

  @property
  def image_span_max_len(self) -> int:
    """Longest image span (alignment pad included): how far span attention reaches; 0 = none."""
    return max_span_positions(self.vision_max_image_tokens) if self.vision else 0

  @property
  def roles(self) -> tuple['LayerRole', ...]:
    return layer_roles(self)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  seq_len: int
  sources: tuple[tuple[str, float], ...]   # (prepared dataset dir, weight); () = default corpus
  synthetic: bool
  cache_dir: str
  default_corpus_vocab_size: int
  default_corpus_max_files: int
  shuffle_seed: int
  num_workers: int
  prefetch: int
  packing_bins: int
  document_align: int
  image_sources: tuple[tuple[str, float], ...]  # (shapes | pairs dir | .jsonl, weight)
  max_images_per_row: int
  image_heldout_fraction: float
  shapes_image_size: int
  images: ImageGeometry | None                  # None when model.vision is off


@dataclasses.dataclass(frozen=True)
class ImageGeometry:
  """What the data pipeline needs of the vision model to lay out image spans and patches."""
  patch_size: int
  merge: int
  max_image_tokens: int
  min_pixels: int
  image_token_id: int
  max_images_per_row: int

  @property
  def max_patches(self) -> int:
    return self.merge * self.merge * self.max_image_tokens


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int
  batch_size: int
  grad_accum_steps: int
  seed: int
  lr: float
  min_lr_ratio: float
  warmup_steps: int
  schedule: str
  wsd_decay_fraction: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  grad_clip_norm: float
  engram_table_lr_multiplier: float
  vision_lr_multiplier: float
  remat: str
  eval_every_steps: int
  eval_batches: int
  peak_tflops: float


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int
  fsdp: int
  expert: int
  tensor: int
  context: int
  rules: tuple[tuple[str, tuple[str, ...]], ...]

  AXES = ('data', 'fsdp', 'expert', 'tensor', 'context')

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, a) for a in self.AXES)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int
  max_to_keep: int
  keep_period: int
  async_save: bool


@dataclasses.dataclass(frozen=True)
class LogConfig:
  every_steps: int
  tensorboard: bool
  progress_bar: bool
  profile_start_step: int
  profile_steps: int


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  data: DataConfig
  train: TrainConfig
  mesh: MeshConfig
  checkpoint: CheckpointConfig
  log: LogConfig

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# Layer roles (DESIGN.md "Layer roles"): the model never tests layer numbers, it reads this table.

SWA, FULL, REINDEX, REUSE = 'SWA', 'Full', 'Reindex', 'Reuse'


@dataclasses.dataclass(frozen=True)
class LayerRole:
  layer: int
  block: str                # encoder | decoder
  ratio: int                # 0 = SWA only
  mode: str                 # SWA | Full | Reindex | Reuse
  kv_source: int            # -1 for SWA-only layers
  index_source: int         # -1 for SWA-only layers
  publishes_candidates: bool
  uses_candidates: bool     # Reindex layers after the candidate source select inside its pool
  engram: bool
  rope: str                 # main | compress


def _latest_at_or_below(sources: tuple[int, ...], layer: int) -> int:
  below = [s for s in sources if s <= layer]
  return max(below) if below else -1


def layer_roles(m: ModelConfig) -> tuple[LayerRole, ...]:
  roles = []
  for l in range(m.num_layers):
    r = m.compress_ratios[l]
    engram = l in m.engram_layer_ids
    block = 'encoder' if l < m.num_encoder_layers else 'decoder'
    if r == 0:
      roles.append(LayerRole(l, block, 0, SWA, -1, -1, False, False, engram, 'main'))
      continue
    kv_src = _latest_at_or_below(m.kv_source_layer_ids, l)
    idx_src = _latest_at_or_below(m.index_source_layer_ids, l)
    if idx_src != l:
      mode = REUSE
    elif kv_src == l:
      mode = FULL
    else:
      mode = REINDEX
    cand = m.candidate_source_layer_id
    roles.append(LayerRole(
        layer=l, block=block, ratio=r, mode=mode, kv_source=kv_src, index_source=idx_src,
        publishes_candidates=(l == cand),
        uses_candidates=(mode == REINDEX and cand >= 0 and kv_src == cand and l > cand),
        engram=engram, rope='compress'))
  return tuple(roles)


def format_role_table(m: ModelConfig) -> str:
  head = f"{'layer':>5} {'block':<8} {'ratio':>5} {'mode':<8} {'kv_src':>6} {'idx_src':>7} " \
         f"{'cand':<9} {'engram':<6} {'rope':<8}"
  lines = [head]
  for r in layer_roles(m):
    cand = 'publish' if r.publishes_candidates else ('restrict' if r.uses_candidates else '-')
    lines.append(
        f'{r.layer:>5} {r.block:<8} {r.ratio:>5} {r.mode:<8} {r.kv_source:>6} {r.index_source:>7} '
        f"{cand:<9} {'yes' if r.engram else '-':<6} {r.rope:<8}")
  return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------
# Validation and resolution.


def _check_keys(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict, prefix=''):
  for key in cfg.keys():
    full = f'{prefix}{key}'
    if key not in schema:
      close = [k for k in schema.keys() if k.lower() == key.lower() or k.startswith(key[:3])]
      hint = f' (did you mean {", ".join(prefix + k for k in close)}?)' if close else ''
      raise ConfigError(f'unknown config key {full!r}{hint}')
    if isinstance(schema[key], ml_collections.ConfigDict):
      if not isinstance(cfg[key], ml_collections.ConfigDict):
        raise ConfigError(f'config key {full!r} must be a section, got {cfg[key]!r}')
      _check_keys(cfg[key], schema[key], full + '.')
  for key in schema.keys():
    if key not in cfg:
      raise ConfigError(f'config is missing key {prefix}{key}; start config files from '
                        'deepseek41.config.base_config()')


def _req(cond: bool, key: str, msg: str):
  if not cond:
    raise ConfigError(f'{key}: {msg}')


def _tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def parse_sources(spec: str, key: str = 'data.sources') -> tuple[tuple[str, float], ...]:
  out = []
  for part in [p.strip() for p in spec.split(',') if p.strip()]:
    path, weight = part, 1.0
    head, sep, tail = part.rpartition(':')
    if sep:
      try:
        weight = float(tail)
        path = head
      except ValueError:
        pass
    _req(weight > 0, key, f'weight of {path!r} must be > 0, got {weight}')
    out.append((path, weight))
  return tuple(out)


def index_scores_supported(heads: int, dim: int) -> bool:
  """Shapes the fused indexer kernel takes (ops/index_scores.py): powers of two, width >= 16."""
  pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
  return pow2(heads) and pow2(dim) and dim >= 16


def _default_backend() -> str:
  import jax  # imported lazily: validating a config must not need a device
  return jax.default_backend()


def _validate_model(m: ml_collections.ConfigDict, backend: str) -> ModelConfig:
  L = m.num_layers
  _req(L >= 1, 'model.num_layers', f'must be >= 1, got {L}')
  _req(0 <= m.num_encoder_layers <= L, 'model.num_encoder_layers',
       f'must be in [0, num_layers={L}], got {m.num_encoder_layers}')
  for k in ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'q_lora_rank', 'o_groups',
            'o_lora_rank', 'sliding_window', 'n_routed_experts', 'num_experts_per_tok',
            'moe_intermediate_size'):
    _req(int(m[k]) >= 1, f'model.{k}', f'must be >= 1, got {m[k]}')
  _req(m.n_shared_experts >= 0, 'model.n_shared_experts', 'must be >= 0')
  _req(m.rope_head_dim % 2 == 0 and 0 < m.rope_head_dim <= m.head_dim, 'model.rope_head_dim',
       f'must be even and in (0, head_dim={m.head_dim}], got {m.rope_head_dim}')
  _req(m.num_heads % m.o_groups == 0, 'model.o_groups',
       f'must divide num_heads={m.num_heads}, got {m.o_groups}')
  _req(m.num_experts_per_tok <= m.n_routed_experts, 'model.num_experts_per_tok',
       f'top-{m.num_experts_per_tok} of {m.n_routed_experts} experts is impossible')
  ratios = tuple(int(r) for r in _tuple(m.compress_ratios))
  _req(len(ratios) == L, 'model.compress_ratios',
       f'needs one entry per layer (num_layers={L}), got {len(ratios)}')
  _req(all(r in (0, 1, 2) for r in ratios), 'model.compress_ratios',
       f'entries must be 0, 1 or 2, got {ratios}')
  kv = tuple(int(i) for i in _tuple(m.kv_source_layer_ids))
  idx = tuple(int(i) for i in _tuple(m.index_source_layer_ids))
  eng = tuple(int(i) for i in _tuple(m.engram_layer_ids))
  for key, ids in (('kv_source_layer_ids', kv), ('index_source_layer_ids', idx),
                   ('engram_layer_ids', eng)):
    _req(list(ids) == sorted(set(ids)), f'model.{key}', f'must be sorted and unique, got {ids}')
    for i in ids:
      _req(0 <= i < L, f'model.{key}', f'layer id {i} out of range [0, {L})')
  for i in kv + idx:
    _req(ratios[i] > 0, 'model.kv_source_layer_ids / index_source_layer_ids',
         f'layer {i} has compress ratio 0 (SWA only) and cannot be a KV or index source')
  for l, r in enumerate(ratios):
    if r == 0:
      continue
    s = _latest_at_or_below(kv, l)
    _req(s >= 0, 'model.kv_source_layer_ids', f'layer {l} (ratio {r}) has no KV source at or below it')
    _req(ratios[s] == r, 'model.compress_ratios',
         f'layer {l} has ratio {r} but its KV source layer {s} has ratio {ratios[s]}')
    i = _latest_at_or_below(idx, l)
    _req(i >= 0, 'model.index_source_layer_ids',
         f'layer {l} (ratio {r}) has no index source at or below it')
    _req(i >= s, 'model.index_source_layer_ids',
         f'layer {l}: its index source {i} precedes its KV source {s}')
  cand = int(m.candidate_source_layer_id)
  if cand >= 0:
    _req(cand in idx and cand in kv, 'model.candidate_source_layer_id',
         f'layer {cand} must be both a KV source and an index source')
    _req(m.index_topk <= m.candidate_topk_blocks * m.candidate_block_size,
         'model.index_topk', f'top-{m.index_topk} is larger than the candidate pool '
         f'({m.candidate_topk_blocks} blocks x {m.candidate_block_size})')
  _req(m.num_encoder_layers == 0 or m.num_encoder_layers == L or
       all(_latest_at_or_below(kv, l) >= m.num_encoder_layers or ratios[l] == 0
           for l in range(m.num_encoder_layers, L)), 'model.num_encoder_layers',
       'decoder layers must read KV produced inside the decoder (CED wiring)')
  residuals = ('mhc_single_pass', 'mhc_multi_pass', 'plain')
  _req(m.residual in residuals, 'model.residual', f'must be one of {residuals}, got {m.residual!r}')
  _req(m.hc_mult >= 1, 'model.hc_mult', f'must be >= 1, got {m.hc_mult}')
  _req(m.hc_sinkhorn_iters >= 1, 'model.hc_sinkhorn_iters', 'must be >= 1')
  _req(m.hc_eps >= 0, 'model.hc_eps', 'must be >= 0')
  _req(m.engram_max_ngram >= 2, 'model.engram_max_ngram', 'must be >= 2 (2-grams and up)')
  _req(m.engram_n_heads >= 1 and m.engram_head_dim >= 1, 'model.engram_n_heads',
       'engram_n_heads and engram_head_dim must be >= 1')
  _req(2 <= m.engram_vocab_start < 2**24 - 2**16, 'model.engram_vocab_start',
       f'must be in [2, 2^24 - 2^16) (exact 32-bit hashing), got {m.engram_vocab_start}')
  _req(m.engram_compressed_vocab_size >= 0, 'model.engram_compressed_vocab_size', 'must be >= 0')
  _req(m.engram_table_row_multiple >= 1, 'model.engram_table_row_multiple', 'must be >= 1')
  _req(0 <= m.engram_pad_token_id < (m.engram_compressed_vocab_size or m.vocab_size),
       'model.engram_pad_token_id', 'must be an id of the hashed vocabulary')
  _req(m.index_topk >= 1, 'model.index_topk', 'must be >= 1')
  _req(m.index_n_heads >= 1, 'model.index_n_heads', 'must be >= 1')
  _req(m.indexer_loss_weight >= 0, 'model.indexer_loss_weight', 'must be >= 0')
  _req(m.index_head_dim >= 2 and m.index_head_dim % 2 == 0 and
       m.index_head_dim >= m.rope_head_dim, 'model.index_head_dim',
       f'must be even and >= rope_head_dim ({m.rope_head_dim}), got {m.index_head_dim}')
  _req(m.sparse_chunk >= 1, 'model.sparse_chunk', 'must be >= 1')
  _req(m.index_topk_block >= 0, 'model.index_topk_block', 'must be >= 0 (0 = one top-k pass)')
  sparse_impls = ('auto', 'reference', 'gathered')
  _req(m.sparse_impl in sparse_impls, 'model.sparse_impl',
       f'must be one of {sparse_impls}, got {m.sparse_impl!r}')
  quant_formats = ('none', 'fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32')
  for key in ('kv_quant', 'index_quant', 'swa_quant'):
    _req(m[key] in quant_formats, f'model.{key}',
         f'must be one of {quant_formats}, got {m[key]!r}')
  _req(m.yarn_factor >= 1.0, 'model.yarn_factor', f'must be >= 1, got {m.yarn_factor}')
  _req(m.rms_norm_eps > 0, 'model.rms_norm_eps', 'must be > 0')
  _req(m.capacity_factor > 0, 'model.capacity_factor', 'must be > 0')
  _req(m.router_bias_rate >= 0, 'model.router_bias_rate', 'must be >= 0')
  _req(m.balance_loss_weight >= 0, 'model.balance_loss_weight', 'must be >= 0')

  backends = ('auto', 'reference', 'capacity_einsum', 'ragged_dot')
  _req(m.moe_backend in backends, 'model.moe_backend', f'must be one of {backends}, got {m.moe_backend!r}')
  moe_backend = m.moe_backend
  if moe_backend == 'auto':
    # Measured on the H200 (docs/performance.md): ragged_dot costs E dense matmuls on GPU/CPU.
    moe_backend = 'ragged_dot' if backend == 'tpu' else 'capacity_einsum'
  impls = ('auto', 'reference', 'chunked')
  _req(m.attention_impl in impls, 'model.attention_impl',
       f'must be one of {impls}, got {m.attention_impl!r}')
  attention_impl = 'chunked' if m.attention_impl == 'auto' else m.attention_impl
  if m.vision:
    for k in ('vision_layers', 'vision_dim', 'vision_heads', 'vision_mlp', 'vision_patch',
              'vision_merge', 'vision_max_image_tokens'):
      _req(int(m[k]) >= 1, f'model.{k}', f'must be >= 1, got {m[k]}')
    _req(m.vision_dim % m.vision_heads == 0 and (m.vision_dim // m.vision_heads) % 4 == 0,
         'model.vision_heads', f'vision_dim={m.vision_dim} / vision_heads={m.vision_heads} must '
         'be a whole head dim divisible by 4 (2D RoPE rotates row and column halves in pairs)')
    _req(m.vision_min_pixels >= 0, 'model.vision_min_pixels', 'must be >= 0')
  _req(0 <= m.image_token_id < m.vocab_size, 'model.image_token_id',
       f'must be in [0, vocab_size={m.vocab_size}), got {m.image_token_id}')
  _req(m.vision_attention_impl in ('auto', 'reference', 'fused'), 'model.vision_attention_impl',
       f'must be auto, reference or fused, got {m.vision_attention_impl!r}')
  vision_attention_impl = m.vision_attention_impl
  if vision_attention_impl == 'auto':
    vision_attention_impl = 'reference' if backend == 'cpu' else 'fused'
  index_impls = ('auto', 'reference', 'fused')
  _req(m.index_impl in index_impls, 'model.index_impl',
       f'must be one of {index_impls}, got {m.index_impl!r}')
  fused_ok = index_scores_supported(m.index_n_heads, m.index_head_dim)
  _req(m.index_impl != 'fused' or (fused_ok and backend == 'gpu'), 'model.index_impl',
       f"'fused' is a GPU kernel for power-of-two index_n_heads and index_head_dim >= 16 "
       f'(got {m.index_n_heads} x {m.index_head_dim} on {backend})')
  index_impl = m.index_impl
  if index_impl == 'auto':
    index_impl = 'fused' if backend == 'gpu' and fused_ok else 'reference'
  dtypes = ('auto', 'float32', 'bfloat16')
  _req(m.compute_dtype in dtypes, 'model.compute_dtype', f'must be one of {dtypes}, got {m.compute_dtype!r}')
  compute_dtype = m.compute_dtype
  if compute_dtype == 'auto':
    compute_dtype = 'float32' if backend == 'cpu' else 'bfloat16'
  _req(m.param_dtype in ('float32', 'bfloat16'), 'model.param_dtype',
       f'must be float32 or bfloat16, got {m.param_dtype!r}')

  return ModelConfig(
      vocab_size=int(m.vocab_size), d_model=int(m.d_model), num_layers=L,
      num_encoder_layers=int(m.num_encoder_layers), num_heads=int(m.num_heads),
      head_dim=int(m.head_dim), rope_head_dim=int(m.rope_head_dim),
      q_lora_rank=int(m.q_lora_rank), o_groups=int(m.o_groups), o_lora_rank=int(m.o_lora_rank),
      sliding_window=int(m.sliding_window), q_head_norm=bool(m.q_head_norm),
      compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=idx,
      candidate_source_layer_id=cand, engram_layer_ids=eng, csa2=bool(m.csa2),
      engram=bool(m.engram), engram_max_ngram=int(m.engram_max_ngram),
      engram_n_heads=int(m.engram_n_heads), engram_head_dim=int(m.engram_head_dim),
      engram_vocab_start=int(m.engram_vocab_start),
      engram_pad_token_id=int(m.engram_pad_token_id),
      engram_compressed_vocab_size=int(m.engram_compressed_vocab_size),
      engram_table_row_multiple=int(m.engram_table_row_multiple),
      residual=str(m.residual), hc_mult=int(m.hc_mult),
      hc_sinkhorn_iters=int(m.hc_sinkhorn_iters), hc_eps=float(m.hc_eps),
      hc_init_std=float(m.hc_init_std),
      index_n_heads=int(m.index_n_heads), index_head_dim=int(m.index_head_dim),
      index_topk=int(m.index_topk), indexer_loss_weight=float(m.indexer_loss_weight),
      candidate_topk_blocks=int(m.candidate_topk_blocks),
      candidate_block_size=int(m.candidate_block_size),
      index_topk_block=int(m.index_topk_block), rope_theta=float(m.rope_theta),
      compress_rope_theta=float(m.compress_rope_theta), yarn_factor=float(m.yarn_factor),
      yarn_original_max_position=int(m.yarn_original_max_position),
      yarn_beta_fast=float(m.yarn_beta_fast), yarn_beta_slow=float(m.yarn_beta_slow),
      rms_norm_eps=float(m.rms_norm_eps), n_routed_experts=int(m.n_routed_experts),
      num_experts_per_tok=int(m.num_experts_per_tok), n_shared_experts=int(m.n_shared_experts),
      moe_intermediate_size=int(m.moe_intermediate_size), route_scale=float(m.route_scale),
      swiglu_limit=float(m.swiglu_limit), router_bias_rate=float(m.router_bias_rate),
      balance_loss_weight=float(m.balance_loss_weight), moe_backend=moe_backend,
      capacity_factor=float(m.capacity_factor), attention_impl=attention_impl,
      sparse_impl='gathered' if m.sparse_impl == 'auto' else m.sparse_impl,
      sparse_chunk=int(m.sparse_chunk), index_impl=index_impl, kv_quant=m.kv_quant, index_quant=m.index_quant,
      swa_quant=m.swa_quant,
      init_std=float(m.init_std), compute_dtype=compute_dtype, param_dtype=m.param_dtype,
      vision=bool(m.vision), vision_layers=int(m.vision_layers), vision_dim=int(m.vision_dim),
      vision_heads=int(m.vision_heads), vision_mlp=int(m.vision_mlp),
      vision_patch=int(m.vision_patch), vision_merge=int(m.vision_merge),
      vision_rope_theta=float(m.vision_rope_theta), vision_norm_eps=float(m.vision_norm_eps),
      vision_max_image_tokens=int(m.vision_max_image_tokens),
      vision_min_pixels=int(m.vision_min_pixels), vision_attention_impl=vision_attention_impl,
      image_token_id=int(m.image_token_id))


def _validate_mesh(ms: ml_collections.ConfigDict, num_devices: int | None) -> MeshConfig:
  sizes = {a: int(ms[a]) for a in MeshConfig.AXES}
  fill = [a for a, s in sizes.items() if s == -1]
  _req(len(fill) <= 1, 'mesh', f'at most one axis may be -1, got {fill}')
  for a, s in sizes.items():
    _req(s == -1 or s >= 1, f'mesh.{a}', f'must be >= 1 or -1, got {s}')
  fixed = 1
  for a, s in sizes.items():
    if s != -1:
      fixed *= s
  if num_devices is not None:
    if fill:
      _req(num_devices % fixed == 0, f'mesh.{fill[0]}',
           f'cannot fill: {num_devices} devices are not divisible by the other axes ({fixed})')
      sizes[fill[0]] = num_devices // fixed
    else:
      _req(fixed == num_devices, 'mesh',
           f'axes multiply to {fixed} but {num_devices} devices are present; set one axis to -1')
  elif fill:
    sizes[fill[0]] = 1
  rules = []
  for i, rule in enumerate(ms.rules):
    _req(isinstance(rule, (tuple, list)) and len(rule) == 2, f'mesh.rules[{i}]',
         f'must be a (logical_axis, "mesh_axis[,mesh_axis]") pair, got {rule!r}')
    name, axes = rule
    axes_t = tuple(a.strip() for a in str(axes).split(',') if a.strip())
    for a in axes_t:
      _req(a in MeshConfig.AXES, f'mesh.rules[{i}]', f'unknown mesh axis {a!r} for {name!r}')
    rules.append((str(name), axes_t))
  return MeshConfig(**sizes, rules=tuple(rules))


def resolve(cfg: ml_collections.ConfigDict, *, num_devices: int | None = None,
            backend: str | None = None) -> RunConfig:
  """Validate `cfg` against the schema and the devices; return the frozen RunConfig."""
  _check_keys(cfg, base_config())
  backend = backend or _default_backend()
  if num_devices is None and backend is not None:
    import jax
    num_devices = jax.device_count()
  model = _validate_model(cfg.model, backend)
  mesh = _validate_mesh(cfg.mesh, num_devices)

  d = cfg.data
  _req(d.seq_len >= 2, 'data.seq_len', f'must be >= 2, got {d.seq_len}')
  _req(d.num_workers >= 0, 'data.num_workers', 'must be >= 0')
  _req(d.prefetch >= 0, 'data.prefetch', 'must be >= 0')
  _req(d.packing_bins >= 1, 'data.packing_bins', 'must be >= 1')
  _req(d.document_align >= 1 and d.seq_len % d.document_align == 0, 'data.document_align',
       f'must be >= 1 and divide data.seq_len={d.seq_len}, got {d.document_align}')
  if model.csa2 and 2 in model.compress_ratios:
    _req(d.document_align % 2 == 0, 'data.document_align',
         'must be even with ratio-2 layers, or compressed groups would straddle documents')
  _req(d.default_corpus_vocab_size >= 259, 'data.default_corpus_vocab_size',
       'must be >= 259 (256 bytes + special tokens)')
  if not d.sources and not d.synthetic:
    _req(model.vocab_size >= d.default_corpus_vocab_size, 'model.vocab_size',
         f'{model.vocab_size} is smaller than data.default_corpus_vocab_size '
         f'({d.default_corpus_vocab_size})')
  image_sources = parse_sources(d.image_sources, 'data.image_sources')
  _req(not image_sources or model.vision, 'data.image_sources',
       'needs model.vision=True (image sources feed the vision encoder)')
  _req(d.max_images_per_row >= 1, 'data.max_images_per_row', 'must be >= 1')
  _req(0 <= d.image_heldout_fraction < 1, 'data.image_heldout_fraction', 'must be in [0, 1)')
  _req(d.shapes_image_size >= 1, 'data.shapes_image_size', 'must be >= 1')
  if model.vision:
    _req(max_span_positions(model.vision_max_image_tokens) <= d.seq_len,
         'model.vision_max_image_tokens',
         f'the longest image span ({max_span_positions(model.vision_max_image_tokens)} '
         f'positions) must fit in data.seq_len={d.seq_len}, or packing could not keep it whole')
  images = ImageGeometry(
      patch_size=model.vision_patch, merge=model.vision_merge,
      max_image_tokens=model.vision_max_image_tokens, min_pixels=model.vision_min_pixels,
      image_token_id=model.image_token_id,
      max_images_per_row=int(d.max_images_per_row)) if model.vision else None
  data = DataConfig(
      image_sources=image_sources, max_images_per_row=int(d.max_images_per_row),
      image_heldout_fraction=float(d.image_heldout_fraction),
      shapes_image_size=int(d.shapes_image_size), images=images,
      seq_len=int(d.seq_len), sources=parse_sources(d.sources), synthetic=bool(d.synthetic),
      cache_dir=str(d.cache_dir), default_corpus_vocab_size=int(d.default_corpus_vocab_size),
      default_corpus_max_files=int(d.default_corpus_max_files), shuffle_seed=int(d.shuffle_seed),
      num_workers=int(d.num_workers), prefetch=int(d.prefetch), packing_bins=int(d.packing_bins),
      document_align=int(d.document_align))

  t = cfg.train
  _req(t.steps >= 1, 'train.steps', f'must be >= 1, got {t.steps}')
  _req(t.batch_size >= 1, 'train.batch_size', f'must be >= 1, got {t.batch_size}')
  _req(t.grad_accum_steps >= 1, 'train.grad_accum_steps', 'must be >= 1')
  _req(t.batch_size % t.grad_accum_steps == 0, 'train.grad_accum_steps',
       f'must divide train.batch_size={t.batch_size}, got {t.grad_accum_steps}')
  micro = t.batch_size // t.grad_accum_steps
  batch_shards = 1
  for name, axes in mesh.rules:
    if name == 'batch':
      for a in axes:
        batch_shards *= getattr(mesh, a)
  _req(micro % batch_shards == 0, 'train.batch_size',
       f'the microbatch ({micro} = batch_size / grad_accum_steps) must be divisible by the '
       f'{batch_shards} devices the batch is sharded over (mesh rules for "batch")')
  _req(t.lr > 0, 'train.lr', 'must be > 0')
  _req(0 <= t.min_lr_ratio <= 1, 'train.min_lr_ratio', 'must be in [0, 1]')
  _req(t.warmup_steps >= 0, 'train.warmup_steps', 'must be >= 0')
  _req(t.schedule in ('cosine', 'wsd', 'constant'), 'train.schedule',
       f'must be cosine, wsd or constant, got {t.schedule!r}')
  _req(0 < t.wsd_decay_fraction <= 1, 'train.wsd_decay_fraction', 'must be in (0, 1]')
  _req(t.remat in ('none', 'block'), 'train.remat', f'must be none or block, got {t.remat!r}')
  _req(t.eval_every_steps >= 0, 'train.eval_every_steps', 'must be >= 0')
  _req(t.eval_batches >= 1, 'train.eval_batches', 'must be >= 1')
  _req(t.grad_clip_norm >= 0, 'train.grad_clip_norm', 'must be >= 0')
  _req(t.engram_table_lr_multiplier > 0, 'train.engram_table_lr_multiplier', 'must be > 0')
  _req(t.vision_lr_multiplier > 0, 'train.vision_lr_multiplier', 'must be > 0')
  train = TrainConfig(**{f.name: t[f.name] for f in dataclasses.fields(TrainConfig)})

  ck = cfg.checkpoint
  _req(ck.every_steps >= 0, 'checkpoint.every_steps', 'must be >= 0')
  _req(ck.max_to_keep >= 1, 'checkpoint.max_to_keep', 'must be >= 1')
  _req(ck.keep_period >= 0, 'checkpoint.keep_period', 'must be >= 0')
  checkpoint = CheckpointConfig(**{f.name: ck[f.name] for f in dataclasses.fields(CheckpointConfig)})

  lg = cfg.log
  _req(lg.every_steps >= 1, 'log.every_steps', 'must be >= 1')
  _req(lg.profile_start_step >= 0, 'log.profile_start_step', 'must be >= 0 (0 = no profile)')
  _req(lg.profile_steps >= 1, 'log.profile_steps', 'must be >= 1')
  log = LogConfig(**{f.name: lg[f.name] for f in dataclasses.fields(LogConfig)})
  return RunConfig(model=model, data=data, train=train, mesh=mesh, checkpoint=checkpoint, log=log)


def load_config_file(path: str, overrides: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Load a `get_config()` file (for tests and tools; the CLI uses absl config_flags)."""
  import importlib.util
  import os
  if not os.path.isfile(path):
    raise ConfigError(f'config file {path!r} does not exist')
  spec = importlib.util.spec_from_file_location('_ds41_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  for key, value in (overrides or {}).items():
    node = cfg
    *parents, leaf = key.split('.')
    for p in parents:
      if p not in node:
        raise ConfigError(f'unknown config key {key!r}')
      node = node[p]
    if leaf not in node:
      raise ConfigError(f'unknown config key {key!r}')
    node[leaf] = value
  return cfg
