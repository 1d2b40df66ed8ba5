"""Configuration: declared keys -> validated ConfigDict -> frozen dataclasses -> layer-role table.

    keys.py     how a key is declared (default, choices, `auto` rule, execution-only mark)
    schema.py   the sections (model, data, train, mesh, checkpoint, log, dspark, tasks) and
                base_config()
    tasks.py    the long-context task names and their "task@length" specs
    auto.py     the `auto` policy: each backend's choice of kernels and paths
    checks.py   pure validators, each error a ConfigError naming the key
    resolve.py  resolve(): ConfigDict -> RunConfig; config_from_saved, load_config_file
    roles.py    the layer-role table the model reads (docs/design.md "Layer roles")

Config files under `configs/` start from `base_config()` and override what they need; anything
they or a `--config.a.b=c` override name that is not declared is rejected with the key's full
name. The rest of the package imports what it needs from here.
"""

from deepseek41.config.keys import ConfigError
from deepseek41.config.resolve import (config_from_saved, load_config_file, mesh_rules,
                                       parse_sources, replaced_key_hint, resolve)
from deepseek41.config.roles import (FULL, REINDEX, REUSE, SWA, LayerRole, format_role_table,
                                     layer_roles, remat_label, remats_layer)
from deepseek41.config.schema import (ATTENTION_VARIANTS, DEFAULT_RULES, LAYOUT_VERSION,
                                      QUANT_FORMATS, SECTIONS, CheckpointConfig, DataConfig,
                                      DSparkConfig, ImageGeometry, LogConfig, MeshConfig,
                                      ModelConfig, RunConfig, Sources, TasksConfig, TrainConfig,
                                      base_config, engram_compresses, execution_only_keys,
                                      max_positions, upgrade_saved_model)
from deepseek41.config.tasks import DEPTH_TASKS, TASK_NAMES, TaskSpec, parse_task_specs

__all__ = [
    'ATTENTION_VARIANTS', 'CheckpointConfig', 'ConfigError', 'DEFAULT_RULES', 'DEPTH_TASKS',
    'DSparkConfig', 'DataConfig', 'FULL',
    'ImageGeometry', 'LAYOUT_VERSION', 'LayerRole', 'LogConfig', 'MeshConfig', 'ModelConfig',
    'QUANT_FORMATS', 'REINDEX', 'REUSE', 'RunConfig', 'SECTIONS', 'SWA', 'Sources',
    'TASK_NAMES', 'TaskSpec', 'TasksConfig', 'TrainConfig', 'base_config', 'config_from_saved',
    'engram_compresses', 'execution_only_keys', 'format_role_table', 'layer_roles',
    'load_config_file', 'max_positions', 'mesh_rules', 'parse_sources', 'parse_task_specs',
    'remat_label', 'remats_layer', 'replaced_key_hint', 'resolve', 'upgrade_saved_model',
]
