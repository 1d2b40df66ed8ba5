"""Profiling: the trainer traces the configured steps; benchmarks/trace_summary.py reads traces."""

import glob
import gzip
import json

from benchmarks import trace_summary
from deepseek41.train.trainer import train
from tests.helpers import small_config


def _traces(workdir):
  return glob.glob(str(workdir / 'profile' / '**' / 'perfetto_trace.json.gz'), recursive=True)


def _traced_steps(path):
  """Step numbers of the trainer's StepTraceAnnotation events in a trace."""
  with gzip.open(path, 'rt') as f:
    events = json.load(f)['traceEvents']
  return sorted(int(e['args']['step_num']) for e in events
                if e.get('ph') == 'X' and e.get('name') == 'train')


def test_trainer_traces_the_window_and_the_summary_reads_it(tmp_path, capsys):
  config = small_config(**{'mesh.data': -1, 'log.profile_start_step': 2, 'log.profile_steps': 2})
  # Ends inside the window (steps 2-3): the trace is still stopped and written.
  train(config, str(tmp_path), stop_at_step=2)
  [first] = _traces(tmp_path)
  assert _traced_steps(first) == [2]
  # Resumed past profile_start_step: no second trace.
  assert train(config, str(tmp_path)).step == 4
  assert _traces(tmp_path) == [first]

  assert trace_summary.main([str(tmp_path / 'profile'), '--device-substr', '', '--top', '5']) == 0
  out = capsys.readouterr().out
  assert 'total: device busy' in out
  assert '(c) top 5 kernels' in out


def _fake_gpu_trace(path, modules_line=True):
  """A GPU-shaped trace: a kernel stream plus xprof's derived lines that repeat its time."""
  meta = [
      {'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'pid': 1, 'tid': 7, 'name': 'thread_name', 'args': {'name': 'Stream #7(Kernel)'}},
      {'ph': 'M', 'pid': 1, 'tid': 8, 'name': 'thread_name', 'args': {'name': 'XLA Ops'}},
      {'ph': 'M', 'pid': 1, 'tid': 9, 'name': 'thread_name', 'args': {'name': 'XLA Modules'}},
      {'ph': 'M', 'pid': 2, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
  ]
  fwd = 'jit(train_step)/while/body/eval_jaxpr/jvp(layer3)/attention/csa2/dot_general'
  bwd = 'jit(train_step)/while/body/eval_jaxpr/transpose(jvp(layer3))/attention/csa2/dot_general'
  kernels = [
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 10, 'dur': 30, 'name': 'gemm_fwd',
       'args': {'hlo_op': 'fusion.1', 'name': fwd}},
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 50, 'dur': 50, 'name': 'gemm_bwd',
       'args': {'hlo_op': 'fusion.2', 'name': bwd}},
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 200, 'dur': 20, 'name': 'adam',
       'args': {'hlo_op': 'fusion.3', 'tf_op': 'jit(train_step)/mul'}},
  ]
  derived = [dict(k, tid=8) for k in kernels] + [
      {'ph': 'X', 'pid': 1, 'tid': 9, 'ts': 5, 'dur': 100, 'name': 'jit_train_step(1)'},
      {'ph': 'X', 'pid': 1, 'tid': 9, 'ts': 150, 'dur': 100, 'name': 'jit_train_step(1)'},
      {'ph': 'X', 'pid': 2, 'tid': 1, 'ts': 0, 'dur': 999, 'name': 'PjitFunction(train_step)'},
      {'ph': 'X', 'pid': 2, 'tid': 1, 'ts': 0, 'dur': 3, 'name': 'train', 'args': {'step_num': 5}},
      {'ph': 'X', 'pid': 2, 'tid': 1, 'ts': 4, 'dur': 3, 'name': 'train', 'args': {'step_num': 6}},
  ]
  if not modules_line:
    derived = [e for e in derived if e.get('tid') != 9]
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': meta + kernels + derived}, f)


def test_summary_of_a_gpu_shaped_trace(tmp_path, capsys):
  _fake_gpu_trace(tmp_path / 'perfetto_trace.json.gz')
  assert trace_summary.main([str(tmp_path), '--depth', '3']) == 0
  out = capsys.readouterr().out
  assert 'total: device busy 0.100 ms' in out  # the stream only: derived lines not counted
  assert '2 windows' in out
  lines = out.splitlines()
  assert any('bwd  layer3/attention/csa2' in l and '50.00' in l for l in lines)
  assert any('fwd  layer3/attention/csa2' in l and '30.00' in l for l in lines)
  assert any('other  mul' in l for l in lines)


def test_summary_counts_host_steps_when_the_device_lines_do_not_split_them(tmp_path, capsys):
  _fake_gpu_trace(tmp_path / 'perfetto_trace.json.gz', modules_line=False)
  assert trace_summary.main([str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert '1 windows' in out
  assert 'the trace holds 2 train steps' in out and '0.050 ms busy per step' in out


def test_scope_parsing():
  parse = trace_summary.parse_scope
  base = 'jit(train_step)/while/body/eval_jaxpr/'
  assert parse(base + 'jvp(layer0)/attention/swa/and') == (
      ['layer0', 'attention', 'swa', 'and'], 'fwd')
  assert parse(base + 'transpose(jvp(layer1))/jvp(layer1)/checkpoint/moe/dot_general') == (
      ['layer1', 'moe', 'dot_general'], 'bwd')
  assert parse(base + 'transpose(jvp(layer1))/jvp(layer1)/checkpoint/rematted_computation/mhc/add'
               ) == (['layer1', 'mhc', 'add'], 'remat')
  assert parse('jit(train_step)/jit(tree_bias_correction)/div') == (['div'], 'other')
  # XLA's joined names of merged ops keep the first.
  assert parse('jit(train_step)/(while/body/eval_jaxpr/jvp(layer3)/moe/reduce_sum:while/body)'
               ) == (['layer3', 'moe', 'reduce_sum'], 'fwd')
  assert trace_summary.name_stack(
      {'long_name': '%fusion.3 = f32[8]{0} fusion(), metadata={op_name="jit(f)/jvp(vision)/add"}'}
  ) == 'jit(f)/jvp(vision)/add'


def test_hlo_dump_names_the_kernels_without_a_name_stack(tmp_path, capsys):
  """A kernel whose event carries no name stack takes its HLO instruction's op_name (`--hlo`),
  found by the event's hlo_op or, without one, by its kernel name (`_N` for `.N`)."""
  meta = [
      {'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'pid': 1, 'tid': 7, 'name': 'thread_name', 'args': {'name': 'Stream #7(Kernel)'}},
  ]
  kernels = [
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 10, 'dur': 40, 'name': 'loop_add_fusion_126',
       'args': {'hlo_op': 'loop_add_fusion.126'}},
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 60, 'dur': 25, 'name': 'input_scatter_fusion_2',
       'args': {}},
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 90, 'dur': 5, 'name': 'unknown_kernel', 'args': {}},
      # a stack that stops at the step: the dump's op_name wins
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 100, 'dur': 30, 'name': 'loop_convert_fusion',
       'args': {'tf_op': 'jit(train_step)'}},
  ]
  with gzip.open(tmp_path / 'perfetto_trace.json.gz', 'wt') as f:
    json.dump({'traceEvents': meta + kernels}, f)
  base = 'jit(train_step)/while/body/eval_jaxpr/'
  hlo = tmp_path / 'module_0001.jit_train_step.after_optimizations.txt'
  hlo.write_text(
      'ENTRY %main {\n'
      f'  %loop_add_fusion.126 = bf16[8]{{0}} fusion(%p), kind=kLoop, calls=%fused_add.126, '
      f'metadata={{op_name="{base}jvp(layer0)/moe/add" source_file="x.py"}}\n'
      f'  ROOT %input_scatter_fusion.2 = f32[8]{{0}} fusion(%q), kind=kInput, '
      f'metadata={{op_name="{base}transpose(jvp(layer9))/jvp(layer9)/checkpoint/attention/csa2/'
      'scatter-add"}\n'
      f'  %loop_convert_fusion = bf16[8]{{0}} fusion(%r), kind=kLoop, '
      f'metadata={{op_name="{base}transpose(jvp(layer11))/attention/convert_element_type"}}\n}}\n')
  assert trace_summary.main([str(tmp_path), '--hlo', str(hlo), '--merge-layers']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert any('fwd  layer*/moe/add' in l and '40.00' in l for l in lines), lines
  assert any('bwd  layer*/attention/csa2' in l for l in lines), lines
  assert any('bwd  layer*/attention/convert_element_type' in l and '30.00' in l
             for l in lines), lines
  assert any('other  (no scope)' in l and '5.00' in l for l in lines), lines
  assert not any('(top level)' in l for l in lines), lines
  # Without the dump the same kernels have no scope.
  assert trace_summary.main([str(tmp_path)]) == 0
  assert 'layer0' not in capsys.readouterr().out
  # Given another module's dump too (first), the one naming the most kernels is read.
  decoy = tmp_path / 'module_0000.jit_train_step.after_optimizations.txt'
  decoy.write_text('ENTRY %main {\n  ROOT %loop_add_fusion.126 = bf16[8]{0} fusion(%p), '
                   'kind=kLoop, metadata={op_name="jit(train_step)/optimizer/add"}\n}\n')
  assert trace_summary.main([str(tmp_path), '--hlo', str(decoy), str(hlo), '--merge-layers']) == 0
  out = capsys.readouterr().out
  assert f'hlo: {hlo} ' in out and 'name 3 of 4 kernel events' in out, out
  assert 'fwd  layer*/moe/add' in out and 'other  optimizer' not in out, out


def test_bodies_print_the_costliest_fusions_hlo(tmp_path, capsys):
  """`--bodies N` prints the fusion's line (no metadata) and its fused computation, costliest
  first, and skips Pallas kernels and kernels the dump does not hold."""
  meta = [
      {'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'pid': 1, 'tid': 7, 'name': 'thread_name', 'args': {'name': 'Stream #7(Kernel)'}},
  ]
  kernels = [
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 0, 'dur': 90, 'name': 'csa2_sparse_dkv', 'args': {}},
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 100, 'dur': 50, 'name': 'loop_convert_fusion_3',
       'args': {}},
      {'ph': 'X', 'pid': 1, 'tid': 7, 'ts': 200, 'dur': 20, 'name': 'input_reduce_fusion',
       'args': {}},
  ]
  with gzip.open(tmp_path / 'perfetto_trace.json.gz', 'wt') as f:
    json.dump({'traceEvents': meta + kernels}, f)
  hlo = tmp_path / 'dump.txt'
  hlo.write_text(
      '%fused_convert.3 (param_0: f32[4,8]) -> bf16[4,8] {\n'
      '  %param_0 = f32[4,8]{1,0} parameter(0)\n'
      '  ROOT %convert.9 = bf16[4,8]{1,0} convert(%param_0), metadata={op_name="a"}\n}\n\n'
      '%fused_reduce (param_0: f32[4,8]) -> f32[4] {\n'
      '  ROOT %reduce.1 = f32[4]{0} reduce(%param_0), dimensions={1}\n}\n\n'
      'ENTRY %main {\n'
      '  %csa2_sparse_dkv = f32[8]{0} custom-call(%p), '
      'custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="x/csa2_sparse_dkv"}\n'
      '  %loop_convert_fusion.3 = bf16[4,8]{1,0} fusion(%p), kind=kLoop, '
      'calls=%fused_convert.3, metadata={op_name="transpose(jvp(layer2))/attention/convert"}\n'
      '  ROOT %input_reduce_fusion = f32[4]{0} fusion(%p), kind=kInput, calls=%fused_reduce, '
      'metadata={op_name="jvp(layer2)/attention/reduce_sum"}\n}\n')
  assert trace_summary.main([str(tmp_path), '--hlo', str(hlo), '--bodies', '1']) == 0
  out = capsys.readouterr().out
  bodies = out.split('(d) ')[1]
  assert 'loop_convert_fusion_3' in bodies and 'convert(%param_0)' in bodies, bodies
  assert 'csa2_sparse_dkv' not in bodies and 'input_reduce_fusion' not in bodies, bodies
  assert 'metadata' not in bodies, bodies
  assert trace_summary.main([str(tmp_path), '--hlo', str(hlo), '--bodies', '5']) == 0
  assert 'reduce(%param_0)' in capsys.readouterr().out.split('(d) ')[1]
