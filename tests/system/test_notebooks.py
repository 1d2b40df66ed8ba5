"""Every notebook runs top to bottom on the CPU (small settings through its parameters cell) and
is stored with its outputs stripped."""

import glob
import os

import jax
import nbformat
import pytest
from tests.helpers import REPO_ROOT
from nbclient import NotebookClient

ROOT = REPO_ROOT
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))
# configs/tiny.py narrowed to four layers that keep every role (SWA, ratio-2 and ratio-1 KV
# sources, Reuse, Reindex with the candidate pool, Engram, mHC) on a 20-file corpus: the
# notebooks' code runs whole at a third of tiny's compile time (tiny itself: the README's quick
# start and tests/system/test_train.py).
SHAPES = {
    'model.d_model': 32, 'model.num_layers': 4, 'model.num_encoder_layers': 2,
    'model.head_dim': 32, 'model.rope_head_dim': 8, 'model.q_lora_rank': 16,
    'model.o_lora_rank': 16, 'model.moe_intermediate_size': 16, 'model.sliding_window': 8,
    'model.compress_ratios': (0, 2, 1, 1), 'model.kv_source_layer_ids': (1, 2),
    'model.index_source_layer_ids': (1, 2, 3), 'model.candidate_source_layer_id': 2,
    'model.engram_layer_ids': (1,), 'model.vocab_size': 320, 'data.seq_len': 48,
    'data.default_corpus_vocab_size': 300, 'data.default_corpus_max_files': 20,
    'train.batch_size': 8, 'train.eval_batches': 2,
}
SMALL = {  # the parameters cell of each notebook, at test size
    '01_quickstart.ipynb': "STEPS = 4\nWORKDIR = {workdir!r}\nOVERRIDES = {overrides!r}",
    '02_kv_cache_and_flops.ipynb': "CONFIG = 'configs/v41_flash.py'",
    # Two learning rates: the schedule is the step's argument, so both runs (and the quick
    # start's) run one compiled program; the notebook's code is the same for any key.
    '03_ablation.ipynb': ("STEPS = 3\nKEY = 'train.lr'\nVALUES = (3e-3, 1e-2)"
                          "\nWORKDIR = {workdir!r}\nOVERRIDES = {overrides!r}"),
}


def test_every_notebook_has_test_settings():
  assert sorted(SMALL) == sorted(os.path.basename(p) for p in NOTEBOOKS)


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
  book = nbformat.read(path, as_version=4)
  assert all(not c.get('outputs') and c.get('execution_count') is None
             for c in book.cells if c.cell_type == 'code'), 'commit notebooks without outputs'
  params = [c for c in book.cells if 'parameters' in c.metadata.get('tags', [])]
  assert len(params) == 1, 'one cell tagged "parameters"'
  overrides = {**SHAPES, 'data.cache_dir': str(tmp_path / 'data'),
               'train.compilation_cache_dir': jax.config.jax_compilation_cache_dir}
  params[0].source = SMALL[os.path.basename(path)].format(workdir=str(tmp_path / 'run'),
                                                          overrides=overrides)
  client = NotebookClient(book, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(ROOT, 'notebooks')}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
