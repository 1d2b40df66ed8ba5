"""Every notebook runs top to bottom on the CPU (small settings through its parameters cell) and
is stored with its outputs stripped."""

import glob
import os

import nbformat
import pytest
from tests.helpers import REPO_ROOT
from nbclient import NotebookClient

ROOT = REPO_ROOT
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))
SMALL = {  # the parameters cell of each notebook, at test size
    '01_quickstart.ipynb': "STEPS = 4\nWORKDIR = {workdir!r}",
    '02_kv_cache_and_flops.ipynb': "CONFIG = 'configs/v41_flash.py'",
    '03_ablation.ipynb': ("STEPS = 3\nKEY = 'model.residual'\nVALUES = ('mhc_single_pass', 'plain')"
                          "\nWORKDIR = {workdir!r}"),
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
  params[0].source = SMALL[os.path.basename(path)].format(workdir=str(tmp_path / 'run'))
  client = NotebookClient(book, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(ROOT, 'notebooks')}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
