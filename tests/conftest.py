"""Test setup: 8 fake CPU devices, f32, a persistent compile cache, parsed absl flags."""

import os

# Must happen before jax is imported anywhere.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The suite's programs are tiny and run once: XLA's LLVM optimisation costs more than it saves
# (a third of each CPU compile; HLO passes and so numerics are unchanged). An environment
# variable, not jax.config, so the trainers the system tier launches as subprocesses get it too.
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')

import jax  # noqa: E402
from absl import flags  # noqa: E402

jax.config.update('jax_compilation_cache_dir',
                  os.path.join(os.path.expanduser('~'), '.cache', 'deepseek41', 'jax-test-cache'))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()

# The fixtures every tier shares live in the one helper module.
from tests.helpers import corpus, pretrained_run  # noqa: E402,F401


def pytest_collection_modifyitems(items):
  """Files whose tests share state run whole on one worker (`pytest.mark.xdist_group`, the
  `loadgroup` mode of pyproject.toml); they are the suite's longest units, so they are handed
  out first and the other tests, one at a time, fill in around them: no long file is left to
  run alone at the end of a tier."""
  items.sort(key=lambda item: item.get_closest_marker('xdist_group') is None)
