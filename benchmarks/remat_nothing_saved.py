"""The trainer with block remat saving nothing (the policy before the selection was saved).

    python benchmarks/remat_nothing_saved.py --config=... [train flags]

An A/B hook for docs/performance.md section 21 (benchmark only): block remat's policy
(`save_only_these_names(csa2.SELECTION)`, model/transformer.py) becomes `nothing_saveable`,
so each index source's backward rescores and reselects, as it did before.
"""

import os
import runpy
import sys

import jax

if __name__ == '__main__':  # not in the data loader's worker processes, which import __main__
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
  jax.checkpoint_policies.save_only_these_names = (
      lambda *names: jax.checkpoint_policies.nothing_saveable)
  sys.argv[0] = 'deepseek41.train'
  runpy.run_module('deepseek41.train', run_name='__main__')
