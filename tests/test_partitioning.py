"""The tiny model (and HyperPrompt) shard on a 2 x 4 (data x model) mesh of 8
simulated CPU devices and compute what the unsharded model computes."""

import os
import pathlib
import subprocess
import sys
import textwrap

import flax
from flax.linen import partitioning as nn_partitioning
import gin
import jax
import numpy as np

from hyperprompt_jax import paths
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import gin_utils
from hyperprompt_jax.runner import partitioning

SCRIPT = textwrap.dedent('''
    import dataclasses
    import jax, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from hyperprompt_jax.methods import hyperprompt
    from hyperprompt_jax.model import network
    from hyperprompt_jax.runner import partitioning

    assert jax.device_count() == 8
    cfg = network.T5Config(vocab_size=384, emb_dim=32, num_heads=4, head_dim=8,
                           mlp_dim=64, num_encoder_layers=2,
                           num_decoder_layers=2, dropout_rate=0.0, num_tasks=8,
                           hyperprompt=hyperprompt.HyperPromptConfig(
                               variant='sep', encoder_prompt_length=4,
                               decoder_prompt_length=2, hypernet_reduction=8))
    model = network.Transformer(cfg)
    rng = np.random.default_rng(0)
    enc = rng.integers(1, 384, (8, 12), dtype=np.int32)
    tgt = rng.integers(1, 384, (8, 4), dtype=np.int32)
    ids = rng.integers(0, 8, (8,), dtype=np.int32)
    init = lambda r: model.init(r, enc, tgt, tgt, enable_dropout=False,
                                task_ids=ids)
    variables = init(jax.random.PRNGKey(0))
    mesh = partitioning.create_mesh(data=2, model=4)
    rules = partitioning.logical_axis_rules()
    shardings = partitioning.parameter_shardings(variables['params_axes'],
                                                 mesh, rules)
    params = jax.device_put(variables['params'], shardings)
    kernel = params['encoder']['layers_0']['mlp']['wi_0']['kernel']
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, 'model')
    assert len(kernel.addressable_shards) == 8
    assert kernel.addressable_shards[0].data.shape == (32, 16)

    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
    def apply(p, e, t, i):
      with nn_partitioning.axis_rules(rules):
        return model.apply({'params': p}, e, t, t, enable_dropout=False,
                           task_ids=i)
    with jax.set_mesh(mesh):
      sharded = jax.jit(apply, in_shardings=(shardings, data, data, data))(
          params, enc, tgt, ids)
    single = model.apply({'params': variables['params']}, enc, tgt, tgt,
                         enable_dropout=False, task_ids=ids)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single),
                               rtol=1e-5, atol=1e-5)
    print('SHARDED_OK')
''')


def test_tiny_model_shards_on_a_2x4_mesh():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
  assert 'SHARDED_OK' in result.stdout, result.stderr[-3000:]


def test_every_variant_has_valid_logical_axes():
  """Each parameter of each shipped variant maps onto the mesh: no axis name
  repeated within an array, every name covered by the rules."""
  variants = sorted(p.name for p in
                    (pathlib.Path(paths.gin_dir()) / 'variants').glob('*.gin'))
  assert 'hyperprompt_global.gin' in variants and 'output_gating.gin' in variants
  rules = partitioning.logical_axis_rules()
  known = {name for name, _ in rules}
  mesh = partitioning.create_mesh()
  enc, dec = np.ones((1, 8), np.int32), np.ones((1, 4), np.int32)
  for variant in variants:
    gin.clear_config()
    small_grid = ['GRID_ROWS=8', 'GRID_COLS=16'] if 'grid' in variant else []
    gin_utils.parse_gin(['models/t5_1_1_tiny.gin', f'variants/{variant}'],
                        small_grid, [])
    model = gin.get_configurable(network.Transformer)()
    abstract = jax.eval_shape(lambda m=model: m.init(
        jax.random.PRNGKey(0), enc, dec, dec, enable_dropout=False,
        task_ids=np.zeros((1,), np.int32)))
    names = flax.core.unfreeze(
        nn_partitioning.get_axis_names(abstract['params_axes']))
    for axes in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)):
      assert len(set(axes)) == len(axes), (variant, axes)
      assert set(axes) <= known, (variant, set(axes) - known)
    partitioning.parameter_shardings(abstract['params_axes'], mesh, rules)
  gin.clear_config()
