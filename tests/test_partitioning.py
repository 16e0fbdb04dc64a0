"""The tiny model (and HyperPrompt) shard on a 2 x 4 (data x model) mesh of 8
simulated CPU devices and compute what the unsharded model computes; packed
rows' task blocks stay on their data shards."""

import os
import pathlib
import subprocess
import sys
import textwrap
import types

import flax
from flax.linen import partitioning as nn_partitioning
import gin
import jax
import numpy as np
import pytest

from hyperprompt_jax import paths
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.model import network

import conftest
import multiprocess

# The scripts' network (without its method), for their bounds.
SCRIPT_DIMS = dict(vocab_size=384, emb_dim=32, num_heads=4, head_dim=8,
                   mlp_dim=64, num_encoder_layers=2, num_decoder_layers=2)

SCRIPT = textwrap.dedent('''
    import dataclasses
    import jax, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from hyperprompt_jax.methods import hyperprompt
    from hyperprompt_jax.model import network
    from hyperprompt_jax.common import partitioning

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
    error = np.abs(np.asarray(sharded) - np.asarray(single)).max()
    assert error <= BOUND * np.abs(np.asarray(single)).max(), error
    print('SHARDED_OK')
''')


# Packed rows on an 8 x 1 (data) mesh: the conditioned variants' task blocks
# are built per data shard, so the step's only collectives are MTL's: the
# all-reduce of the gradients (and the loss's sums). Blocks of the whole
# batch gathered every token's task id and activations onto every device.
# The network (`DIMS` in the script): one encoder and one decoder layer,
# as every layer of a stack builds its blocks alike (each program compiles
# in about half the time of two).
PACKED_DIMS = dict(SCRIPT_DIMS, num_heads=2, head_dim=16,
                   num_encoder_layers=1, num_decoder_layers=1)
PACKED_SCRIPT = textwrap.dedent(r'''
    import math, re, warnings
    import jax, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from hyperprompt_jax.common import partitioning
    from hyperprompt_jax.methods import adapters, hyperprompt
    from hyperprompt_jax.model import network
    from hyperprompt_jax.t5 import traced_mesh
    from hyperprompt_jax.training import trainer

    assert jax.device_count() == 8
    tasks, enc_len, dec_len = 4, 32, 8

    def packed_batch(rows):
      rng = np.random.default_rng(rows)
      batch = {f'{stack}_{k}': np.zeros((rows, n), np.int32)
               for stack, n in (('encoder', enc_len), ('decoder', dec_len))
               for k in ('input_tokens', 'segment_ids', 'positions',
                         'task_ids')}
      for k in ('decoder_target_tokens', 'decoder_loss_weights'):
        batch[k] = np.zeros((rows, dec_len), np.int32)
      for r in range(rows):  # three examples a row, of random tasks
        for seg, (e, d) in enumerate(((0, 0), (10, 3), (20, 5)), start=1):
          a, t = rng.integers(4, 11), rng.integers(1, 4)
          task = rng.integers(tasks)
          for stack, where, n in (('encoder', slice(e, e + a), a),
                                  ('decoder', slice(d, d + t), t)):
            batch[stack + '_segment_ids'][r, where] = seg
            batch[stack + '_positions'][r, where] = np.arange(n)
            batch[stack + '_task_ids'][r, where] = task
          batch['encoder_input_tokens'][r, e:e + a] = rng.integers(2, 384, a)
          targets = rng.integers(2, 384, t)
          batch['decoder_target_tokens'][r, d:d + t] = targets
          batch['decoder_input_tokens'][r, d:d + t] = np.r_[0, targets[:-1]]
          batch['decoder_loss_weights'][r, d:d + t] = 1
      return batch

    mesh = partitioning.create_mesh(data=8, model=1)
    rules = partitioning.logical_axis_rules()
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
    assert traced_mesh.batch_shards(16) == 1  # no mesh
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(rules):
      assert traced_mesh.batch_shards(16) == 8
      assert traced_mesh.batch_shards(12) == 1  # 8 shards do not divide 12
    with warnings.catch_warnings(), nn_partitioning.axis_rules(rules):
      warnings.simplefilter('ignore', DeprecationWarning)
      with mesh:  # t5x's partitioner
        assert traced_mesh.batch_shards(16) == 8

    def compiled_collectives(step, params, batch):
      # The compiled sharded step, and (the kinds of collective, the elements
      # all-reduced) in it.
      with jax.set_mesh(mesh):
        compiled = step.lower(params, batch).compile()
      kinds, elements = set(), 0
      for line in compiled.as_text().splitlines():
        found = re.search(r' = (.+?) (all-gather|all-reduce|all-to-all|'
                          r'collective-permute|reduce-scatter)(-start)?\(', line)
        if found:
          kinds.add(found.group(2))
          elements += sum(math.prod(int(n) for n in dims.split(',') if n)
                          for dims in re.findall(r'\[([0-9,]*)\]',
                                                 found.group(1)))
      return compiled, (kinds, elements)

    variants = {
        'hyperprompt': dict(hyperprompt=hyperprompt.HyperPromptConfig(
            variant='global', encoder_prompt_length=3, decoder_prompt_length=2,
            hypernet_reduction=8, task_embed_dim=5, task_hidden_dim=7,
            layer_task_embed_dim=6)),
        # (HyperFormer++'s generated adapters take the same blocks.)
        'adapter': dict(adapter=adapters.AdapterConfig(reduction=8)),
    }
    for name, extra in variants.items():
      cfg = network.T5Config(**DIMS, dropout_rate=0.1, num_tasks=tasks,
                             **extra)
      model = network.Transformer(cfg)
      variables = jax.jit(lambda r: network.init_variables(model, r, 32, 8))(
          jax.random.PRNGKey(0))
      params = variables['params']
      step = lambda p, b: jax.value_and_grad(lambda p: trainer.loss_fn(
          model, p, b, jax.random.PRNGKey(1), 1e-4)[0])(p)
      shardings = partitioning.parameter_shardings(variables['params_axes'],
                                                   mesh, rules)
      sharded_step = jax.jit(step, in_shardings=(shardings, data))
      batch = packed_batch(16)
      single = jax.jit(step)(params, batch)
      compiled, found = compiled_collectives(sharded_step, params, batch)
      with jax.set_mesh(mesh):
        sharded = compiled(params, batch)
      for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b - a).max() <= BOUND * np.abs(a).max(), name
      # The gradients' all-reduces, the same at twice the rows: nothing the
      # size of the batch crosses devices.
      assert found[0] == {'all-reduce'}, (name, found)
      assert compiled_collectives(sharded_step, params,
                                  packed_batch(32))[1] == found, name
    print('PACKED_SHARDED_OK')
''')


def _run_on_8_devices(script: str, done: str, bound: float) -> None:
  """Runs `script` in a process of 8 simulated CPU devices, with `BOUND`
  the relative float32 bound of its comparisons; it must print `done`."""
  env = dict(os.environ, XLA_FLAGS=multiprocess.xla_flags(8),
             JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c',
                           f'BOUND = {bound!r}\n' + script], env=env,
                          capture_output=True, text=True, timeout=600)
  assert done in result.stdout, result.stderr[-3000:]


def test_tiny_model_shards_on_a_2x4_mesh():
  # The forward pass (prompts 4 and 2, keys of the input 12, targets 4)
  # and the prompts' down and up projections, relative to the largest logit.
  bound = conftest.float32_bound(*conftest.t5_forward_lengths(
      network.T5Config(**SCRIPT_DIMS), 12, 4, 4, 2), 32, 32 // 8)
  _run_on_8_devices(SCRIPT, 'SHARDED_OK', bound)


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


def test_packed_task_blocks_stay_on_their_data_shards():
  # The loss and gradient of 16 rows (32, 8; prompts 3 and 2), and per
  # sublayer an adapter's (or the prompt generator's) down and up
  # projections, forward and backward (2 x 2 a layer); relative to each
  # leaf's largest.
  cfg = network.T5Config(**PACKED_DIMS)
  layers = cfg.num_encoder_layers + cfg.num_decoder_layers
  bound = conftest.float32_bound(*conftest.t5_reduction_lengths(
      cfg, 16, 32, 8, 3, 2), *[32, 32 // 8] * (2 * 2 * layers))
  _run_on_8_devices(f'DIMS = {PACKED_DIMS!r}\n' + PACKED_SCRIPT,
                    'PACKED_SHARDED_OK', bound)


def test_mesh_and_batch_errors_name_the_setting_and_the_fix():
  devices = [object()] * 8  # only counted before the mesh is built
  with pytest.raises(ValueError, match=r'8 devices do not divide into '
                     r'MESH_MODEL=3 parts: set --gin.MESH_MODEL to a divisor'):
    partitioning.create_mesh(model=3, devices=devices)
  with pytest.raises(ValueError, match=r'MESH_DATA=3 x MESH_MODEL=2 needs 6 '
                     r'devices, found 8: set MESH_DATA=-1'):
    partitioning.create_mesh(data=3, model=2, devices=devices)
  mesh = types.SimpleNamespace(shape={'data': 4, 'model': 2})
  with pytest.raises(ValueError, match=r'eval batch size 6 \(EVAL_BATCH_SIZE\) '
                     r'does not divide over the mesh.s 4 data shards: set '
                     r'--gin.EVAL_BATCH_SIZE to a multiple of 4 \(e.g. 8\)'):
    predictor_lib.Predictor(None, None, mesh, batch_size=6,
                            max_decode_length=4)
