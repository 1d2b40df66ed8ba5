"""The trainer with one internal choice reverted, for side-by-side runs (benchmark only).

    python benchmarks/train_variant.py VARIANT --config=... [train flags]

Variants (what they undo, and the docs/performance.md section that measured it):
  remat_nothing_saved   block remat saves nothing, so each index source's backward rescores and
                        reselects (`save_only_these_names(csa2.SELECTION)` in
                        model/transformer.py becomes `nothing_saveable`; section 21)
  sparse_bwd_full_width the sparse kernel's backward forms each block's key/value gradient over
                        the whole head width at once (`dkv_chunk`, ops/gpu/sparse_kernel.py;
                        section 22)
  head_fp32_backward    the LM head's backward by autodiff of its fp32-output product (fp32 /
                        TF32 GEMMs over the vocabulary; `head_logits`, ops/cross_entropy.py;
                        section 23); the whole-logits path only: add
                        --config.model.head_chunk=0 (the fused op has its own backward)
  mhc_no_prefetch       the fused mHC kernels' walks without look-ahead loads, at their earlier
                        tiles (128 x 16 x 8 warps forward, 64 x 16 x 4 backward; section 24)
  sparse_unpipelined    the sparse kernels' earlier tiles: the dq kernel on the fused backward's
                        32-slot steps, no pipelined gathers in either backward kernel, the
                        forward at two stages (`default_tiles`; section 26)
  tiles_before_dec2     the routed-expert GEMMs' and the window forward's earlier tiles: gmm
                        128-column outputs, tgmm 128 x 128 x 64-row steps at 3 stages
                        (`grouped_gemm.GPU_TILES`), the window forward on 32-key steps
                        (`window_partial_fused`'s `block_k`; section 27)
  select_before_dec2    the indexer's query chunks in one run over every entry (no causal runs,
                        `index_causal_groups=1`) and the recall metric's tops by XLA's top_k
                        (model/csa2.py, model/indexer.py; section 28)
  blockmax_slices       an experiment, not a reversal: the indexer's block maxima
                        (`indexer.block_max`) as an elementwise max of the blocks' strided
                        slices instead of a reduction over a minor axis of 8 (section 28 found
                        those reductions at ~1.3 TB/s)
  rope_after_merge      the inverse RoPE of the attention output as its own pass after the merge,
                        which keeps the unrotated merged output for the backward (`merge`'s
                        `rope`, ops/softmax_merge.py; section 32)
"""

import os
import runpy
import sys

import jax


def _remat_nothing_saved():
  jax.checkpoint_policies.save_only_these_names = (
      lambda *names: jax.checkpoint_policies.nothing_saveable)


def _sparse_bwd_full_width():
  from deepseek41.ops.gpu import sparse_kernel  # noqa: PLC0415 (after sys.path is set)
  default = sparse_kernel.default_tiles
  sparse_kernel.default_tiles = lambda heads: (
      default(heads)[0], default(heads)[1]._replace(dkv_chunk=sparse_kernel.FULL_WIDTH))


def _sparse_unpipelined():
  from deepseek41.ops.gpu import sparse_kernel  # noqa: PLC0415
  default = sparse_kernel.default_tiles

  def earlier(heads):
    fwd, bwd = default(heads)
    return (fwd._replace(num_stages=2),
            bwd._replace(num_stages=1, dq_block_k=bwd.block_k, dq_warps=bwd.num_warps,
                         dq_stages=1))
  sparse_kernel.default_tiles = earlier


def _head_fp32_backward():
  import jax.numpy as jnp  # noqa: PLC0415
  from deepseek41.model import transformer  # noqa: PLC0415
  transformer.head_logits = lambda x, w: jnp.einsum('btd,dv->btv', x, w,
                                                    preferred_element_type=jnp.float32)


def _mhc_no_prefetch():
  from deepseek41.ops.gpu import mhc_kernel  # noqa: PLC0415
  mhc_kernel._KNOBS.update(block_d=16, block_d_bwd=16, num_warps_bwd=4, prefetch=False)


def _tiles_before_dec2():
  import functools  # noqa: PLC0415
  from deepseek41.ops import swa_attention  # noqa: PLC0415
  from deepseek41.ops.gpu import grouped_gemm  # noqa: PLC0415
  grouped_gemm.GPU_TILES = grouped_gemm.Tiles(
      block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, block_d=128,
      block_f=128, block_r=64, tgmm_warps=8, tgmm_stages=3, wgrad='mosaic')
  swa_attention.window_partial_fused = functools.partial(swa_attention.window_partial_fused,
                                                         block_k=32)


def _select_before_dec2():
  from deepseek41.model import csa2, indexer  # noqa: PLC0415
  grouped, distill = csa2.causal_groups, indexer.indexer_distillation
  csa2.causal_groups = lambda t, chunk, groups, *rest: grouped(t, chunk, 1, *rest)
  indexer.indexer_distillation = lambda *args, select_impl: distill(*args, select_impl='top_k')


def _blockmax_slices():
  import functools  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from deepseek41.model import indexer  # noqa: PLC0415
  indexer.block_max = lambda x: functools.reduce(
      jnp.maximum, [x[..., j] for j in range(x.shape[-1])])


def _rope_after_merge():
  from deepseek41.model import attention  # noqa: PLC0415
  from deepseek41.ops import softmax_merge  # noqa: PLC0415

  def merge(parts, sink_h, dtype=None, rope=None, positions_bt=None):
    o_bthd, handoffs = softmax_merge.merge(parts, sink_h, dtype=dtype)
    return (o_bthd if rope is None else rope(o_bthd, positions_bt, inverse=True)), handoffs
  attention.merge = merge


VARIANTS = {'remat_nothing_saved': _remat_nothing_saved,
            'sparse_bwd_full_width': _sparse_bwd_full_width,
            'head_fp32_backward': _head_fp32_backward,
            'mhc_no_prefetch': _mhc_no_prefetch,
            'sparse_unpipelined': _sparse_unpipelined,
            'tiles_before_dec2': _tiles_before_dec2,
            'select_before_dec2': _select_before_dec2,
            'blockmax_slices': _blockmax_slices,
            'rope_after_merge': _rope_after_merge}

if __name__ == '__main__':  # not in the data loader's worker processes, which import __main__
  if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
    sys.exit(f'usage: train_variant.py {{{",".join(VARIANTS)}}} --config=... [train flags]')
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
  VARIANTS[sys.argv.pop(1)]()
  sys.argv[0] = 'deepseek41.train'
  runpy.run_module('deepseek41.train', run_name='__main__')
