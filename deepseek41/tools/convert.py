"""Hugging Face checkpoints in and out (docs/hf_interop.md).

    python -m deepseek41.tools.convert import --hf=DIR --workdir=OUT [--mesh=fsdp=8]
        [--config=configs/x.py]
    python -m deepseek41.tools.convert export --workdir=RUN [--step=N] --hf=OUT
        [--dtype=bf16|fp8|fp32] [--tokenizer=DIR]

import: reads DIR/config.json and its safetensors, writes OUT/checkpoints/0 (the parameters and
router biases, a fresh optimizer, step 0), OUT/config.py (the run config: pass it to
`deepseek41.train` and `deepseek41.tools.info`), OUT/tokenizer/ and OUT/import_report.json.
--config supplies the non-model sections (train, data, mesh ...); the model comes from
config.json. --mesh shards the target as the run will (AXIS=SIZE pairs of the mesh section).

export: writes checkpoint --step (default the newest) of RUN as DIR/config.json, sharded
safetensors with their index, and the tokenizer files of --tokenizer (default: RUN/tokenizer.json
or RUN/tokenizer/, where the trainer and the import keep them). --dtype=fp8 stores the
released formats (dense FP8 with block scales, FP4 routed experts, FP8 Engram rows).

Exit status 2 when the input does not fit (the message names the field, tensor or path);
nothing is left in the output directory then.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags

from deepseek41.config import ConfigError, load_config_file
from deepseek41.interop import hf_convert
from deepseek41.interop.hf_config import HFConfigError
from deepseek41.interop.safetensors_io import SafetensorsError
from deepseek41.train.checkpoint import CheckpointError

_HF = flags.DEFINE_string('hf', None, 'The HF checkpoint directory (import: read, export: '
                          'written).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The deepseek41 work directory (import: written).')
_CONFIG = flags.DEFINE_string('config', None, 'import: a get_config() file for the run settings '
                              'other than the model (default: the base config).')
_MESH = flags.DEFINE_string('mesh', '', 'Mesh section overrides, e.g. "fsdp=4,expert=2".')
_STEP = flags.DEFINE_integer('step', None, 'export: the checkpoint step (default: the newest).')
_DTYPE = flags.DEFINE_enum('dtype', 'bf16', ['bf16', 'fp8', 'fp32'], 'export: storage dtype.')
_BLOCK = flags.DEFINE_integer('block', 32, 'export --dtype=fp8: the dense weights\' scale tile.')
_TOKENIZER = flags.DEFINE_string('tokenizer', None, 'export: a directory with tokenizer files '
                                 '(default: the work directory\'s tokenizer.json, if any).')
_SHARD_GB = flags.DEFINE_float('shard_gb', 2.0, 'export: safetensors shard size in GiB.')
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar.')

EXIT_BAD_INPUT = 2


def main(argv):
  logging.getLogger('absl').setLevel(logging.WARNING)
  if len(argv) != 2 or argv[1] not in ('import', 'export'):
    raise app.UsageError('give one command: import or export')
  if not _HF.value or not _WORKDIR.value:
    raise app.UsageError('--hf and --workdir are required')
  try:
    mesh = hf_convert.parse_mesh(_MESH.value)
    if argv[1] == 'import':
      base = load_config_file(_CONFIG.value) if _CONFIG.value else None
      hf_convert.import_hf(_HF.value, _WORKDIR.value, base=base, mesh=mesh,
                           progress=_PROGRESS.value)
    else:
      hf_convert.export_hf(_WORKDIR.value, _HF.value, step=_STEP.value, dtype=_DTYPE.value,
                           block=_BLOCK.value, tokenizer=_TOKENIZER.value, mesh=mesh,
                           shard_bytes=int(_SHARD_GB.value * 2**30), progress=_PROGRESS.value)
  except (hf_convert.ConvertError, HFConfigError, SafetensorsError, ConfigError,
          CheckpointError) as e:
    print(f'convert {argv[1]}: {e}', file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def run():
  """Console-script entry point (`ds41-convert`)."""
  app.run(main)


if __name__ == '__main__':
  run()
