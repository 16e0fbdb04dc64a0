"""Compiles the tiny model of every method for TPU slices, without a TPU.

Run as a script by `test_tpu_compile.py` (`python tests/tpu_programs.py
OUT.json`, or `OUT.json --t5x` for t5x's steps), so that libtpu loads in a
process of its own. With libtpu installed (the `[test]` and `[tpu]`
extras), `jax.experimental.topologies` gives a slice's devices on a
CPU-only machine and `jit(...).lower(...).compile()` compiles for them: the
TPU compiler's own program, memory and cost figures.

Programs, each as the built-in runner builds it: the training step of
`runner.trainer.Trainer` (packed rows, the runner's shardings, checked on
the host) of every method and the greedy decode of
`evaluation.predictor.Predictor` of one model per conditioning path, on a
`v5e:2x2` slice: the batch split two ways over 'data' and the parameters
over a 'model' axis of 2 (all), and the batch split four ways (`BOTH_MESHES`).
With `--t5x`, t5x's train, eval and predict steps (`t5x_programs`).

Per program the JSON holds: the compile time, `memory_analysis()`,
`cost_analysis()` FLOPs and bytes accessed, the host transfers and callback
custom calls left in the optimized module (`host_callbacks`), and each
argument's per-chip shard (`arguments`: shape, dtype, the shard's shape,
the tiled shape as the compiler lays it out, whether it is a parameter and
which of its dimensions the mesh splits), which the test sums.
"""

import dataclasses
import json
import os
import re
import sys
import time

os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no TPU host metadata here
# Compiling only: no TPU is opened, so libtpu's one-process lock need not
# keep another compiling process out.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

# pylint: disable=g-import-not-at-top
import flax
from flax.linen import partitioning as nn_partitioning
import jax
from jax.experimental import topologies
import jax.numpy as jnp
import numpy as np

import conftest
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.methods import adapters
from hyperprompt_jax.methods import hyperformer
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import optimizers
from hyperprompt_jax.runner import partitioning
from hyperprompt_jax.runner import trainer as trainer_lib
from hyperprompt_jax.t5 import inputs

TOPOLOGY = 'v5e:2x2'
# (data, model) axes of the meshes over the slice's 4 chips.
MESHES = {'data4': (4, 1), 'data2_model2': (2, 2)}
BATCH = 8  # rows: divisible by every mesh's data axis
LENGTHS = {'inputs': 16, 'targets': 8}


def _hypergrid(variant, form='auto'):
  return dict(num_tasks=4, hypergrid=hypergrid.HyperGridConfig(
      variant=variant, grid_rows=4, grid_cols=8, max_segments=4,
      packed_form=form))


def _hyperprompt(variant):
  return dict(hyperprompt=dataclasses.replace(conftest.TINY_GLOBAL_PROMPTS,
                                              variant=variant))


# Every method of `methods.REGISTRY` at the tiny size (conftest's t5x test
# configuration), HyperGrid in both packed forms.
MODELS = {
    'mtl': {},
    'hyperprompt_share': _hyperprompt('share'),
    'hyperprompt_sep': _hyperprompt('sep'),
    'hyperprompt_global': _hyperprompt('global'),
    **{f'hypergrid_{v}_{form}': _hypergrid(v, form)
       for v in ('l', 'l2', 'lg', 'gl')
       for form in ('token_blocks', 'grouped')},
    'output_gating': _hypergrid('output_gating'),
    'adapter': dict(adapter=adapters.AdapterConfig(reduction=8)),
    'hyperformer_pp': dict(hyperformer=hyperformer.HyperFormerConfig(
        reduction=8, task_embed_dim=8, task_hidden_dim=16, projected_dim=8)),
    'prompt_tuning': dict(prompt_tuning=prompt_tuning.PromptTuningConfig(
        prompt_length=3)),
}
# The decode of one model of each conditioning path (HyperGrid's forms
# differ in packed training only).
DECODED = ('mtl', 'hyperprompt_global', 'hypergrid_lg_token_blocks',
           'output_gating', 'adapter', 'hyperformer_pp', 'prompt_tuning')
# Compiled on both meshes; every other program on 'data2_model2' only, whose
# batch is split too (a TPU compile takes ~5-15 s a step here).
BOTH_MESHES = ('mtl', 'hypergrid_lg_grouped')


def programs() -> list[tuple[str, str, str]]:
  """`(model, 'train' | 'decode', mesh)` of every program compiled."""
  out = []
  for name in MODELS:
    for mesh in (MESHES if name in BOTH_MESHES else ('data2_model2',)):
      out.append((name, 'train', mesh))
      if name in DECODED:
        out.append((name, 'decode', mesh))
  return out


# What a host callback leaves in an optimized TPU module: send / recv host
# transfers (jax's callbacks on TPU), or a callback custom call (CPU / GPU).
_HOST_TRANSFER = re.compile(r'is_host_transfer=true')
_CALLBACK_TARGET = re.compile(
    r'custom_call_target="([^"]*(?:callback|python)[^"]*)"', re.IGNORECASE)


def model_config(name: str) -> network.T5Config:
  """The tiny model with one layer a stack (a TPU compile's time grows
  with the layers; one holds every path of the method)."""
  return dataclasses.replace(conftest.T5X_TINY_CONFIG, num_encoder_layers=1,
                             num_decoder_layers=1, **MODELS[name])


def mesh_of(devices, data: int, model: int) -> jax.sharding.Mesh:
  auto = jax.sharding.AxisType.Auto  # as `partitioning.create_mesh`
  return jax.sharding.Mesh(np.asarray(devices).reshape(data, model),
                           ('data', 'model'), axis_types=(auto, auto))


def host_callbacks(text: str) -> list[str]:
  """The host transfers and callback custom calls of an HLO module."""
  return (_CALLBACK_TARGET.findall(text)
          + [m.group(0) for m in _HOST_TRANSFER.finditer(text)])


def _packed_batch(sharding) -> dict[str, jax.ShapeDtypeStruct]:
  return {
      name: jax.ShapeDtypeStruct(
          (BATCH, LENGTHS['targets' if name.startswith('decoder') else
                          'inputs']),
          jnp.float32 if name == 'decoder_loss_weights' else jnp.int32,
          sharding=sharding)
      for name in inputs.PACKED_MODEL_FEATURES}


def _figures(compiled, seconds: float, args, param_axes) -> dict:
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0]
  text = compiled.as_text()
  formats = jax.tree.leaves(compiled.input_formats[0])
  leaves = jax.tree_util.tree_leaves_with_path(args)
  assert len(formats) == len(leaves), (len(formats), len(leaves))
  arguments = []
  for (path, leaf), fmt in zip(leaves, formats):
    path = jax.tree_util.keystr(path)
    argument = {'path': path, 'shape': list(leaf.shape),
                'dtype': str(leaf.dtype),
                'itemsize': np.dtype(leaf.dtype).itemsize,
                'axes': param_axes.get(path)}  # a parameter's logical axes
    if fmt.layout is None:  # unused: pruned from the program
      arguments.append(dict(argument, pruned=True))
      continue
    shard = fmt.sharding.shard_shape(leaf.shape)  # as the program takes it
    layout = fmt.layout
    arguments.append(dict(
        argument, pruned=False, shard=list(shard),
        tiled=list(_tiled([shard[i] for i in layout.major_to_minor],
                          layout.tiling[0] if layout.tiling else ()))))
  return {
      'compile_s': seconds,
      'memory': {k: getattr(memory, k) for k in (
          'argument_size_in_bytes', 'output_size_in_bytes',
          'alias_size_in_bytes', 'temp_size_in_bytes',
          'generated_code_size_in_bytes')},
      'flops': cost.get('flops'),
      'bytes_accessed': cost.get('bytes accessed'),
      'host_callbacks': host_callbacks(text),
      'arguments': arguments,
  }


def _param_axes(params_axes, prefix) -> dict[str, list]:
  """keystr of each parameter (under `prefix`) -> its logical axis names."""
  names = nn_partitioning.get_axis_names(params_axes)
  return {jax.tree_util.keystr(tuple(prefix) + path): list(axes)
          for path, axes in jax.tree_util.tree_leaves_with_path(
              flax.core.unfreeze(names),
              is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}


def _tiled(physical, tile) -> tuple[int, ...]:
  """A shape in its layout's order (major to minor) with its minor
  dimensions rounded up to the layout's tile (a scalar is one element)."""
  shape = list(physical) or [1]
  tile = list(tile)[-len(shape):] if tile else []
  offset = len(shape) - len(tile)
  for i, t in enumerate(tile):
    shape[offset + i] = -(-shape[offset + i] // t) * t
  return tuple(shape)


def train_step(name: str, mesh: jax.sharding.Mesh) -> dict:
  """The built-in runner's training step on packed rows."""
  model = network.Transformer(model_config(name))
  trainer = trainer_lib.Trainer(model, optimizers.make_optimizer(), mesh,
                                LENGTHS, checked_on_host=True)
  state = trainer.abstract_state()
  batch = _packed_batch(trainer.batch_sharding)
  axes = _param_axes(
      network.abstract_variables(model, LENGTHS['inputs'],
                                 LENGTHS['targets'])['params_axes'],
      (jax.tree_util.SequenceKey(0), jax.tree_util.DictKey('params')))
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = trainer.step_function().lower(state, batch).compile()
  return _figures(compiled, time.perf_counter() - start, (state, batch),
                  axes)


def decode(name: str, mesh: jax.sharding.Mesh) -> dict:
  """The evaluator's greedy decode (`Predictor`)."""
  model = network.Transformer(model_config(name))
  abstract = network.abstract_variables(model)
  predictor = predictor_lib.Predictor(
      model, abstract['params_axes'], mesh, batch_size=BATCH,
      max_decode_length=LENGTHS['targets'])
  params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract['params'], predictor.param_shardings)
  tokens = jax.ShapeDtypeStruct((BATCH, LENGTHS['inputs']), jnp.int32,
                                sharding=predictor.batch_sharding)
  ids = jax.ShapeDtypeStruct((BATCH,), jnp.int32,
                             sharding=predictor.batch_sharding)
  axes = _param_axes(abstract['params_axes'],
                     (jax.tree_util.SequenceKey(0),))
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = predictor.decode_function().lower(params, tokens,
                                                 ids).compile()
  return _figures(compiled, time.perf_counter() - start,
                  (params, tokens, ids), axes)


def controls(devices) -> dict:
  """What the checks are measured against: the host callback of a program
  that has one, as `host_callbacks` finds it; and the training step with
  the network's in-graph task-id check (`checked_on_host=False`, a
  partitioned host callback) on a split batch, which the TPU compiler
  refuses."""
  mesh = mesh_of(devices[:1], 1, 1)

  def with_callback(x):
    jax.debug.callback(lambda v: None, x.max())
    return x * 2

  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.NamedSharding(
                               mesh, jax.sharding.PartitionSpec()))
  found = host_callbacks(jax.jit(with_callback).lower(x).compile().as_text())
  model = network.Transformer(model_config('mtl'))
  mesh = mesh_of(devices, *MESHES['data4'])
  trainer = trainer_lib.Trainer(model, optimizers.make_optimizer(), mesh,
                                LENGTHS, checked_on_host=False)
  try:
    with jax.set_mesh(mesh):
      trainer.step_function().lower(
          trainer.abstract_state(),
          _packed_batch(trainer.batch_sharding)).compile()
    in_graph_check = None
  except Exception as e:  # pylint: disable=broad-except
    in_graph_check = f'{type(e).__name__}: {e}'
  return {'callback_found': found, 'in_graph_check_error': in_graph_check}


# t5x's programs (`t5x_programs`): the training step of each model on packed
# rows, its eval loss and beam search on unpacked ones.
T5X_MODELS = ('hyperprompt_global', 'hypergrid_lg_token_blocks')
T5X_PREDICTED = ('hyperprompt_global',)


def t5x_programs(devices) -> dict:
  """t5x's train, eval and predict steps of the adapter
  (`t5x_model.TaskIdsEncoderDecoderModel`, its default feature converter),
  partitioned by t5x's `PjitPartitioner` with the project's axis rules
  (gin/t5x/model.gin) over the slice, the batch split four ways; and, for
  reference, the train step with a converter that checks no ids (the
  network's in-graph check stays)."""
  from t5x import decoding as t5x_decoding
  from t5x import optimizers as t5x_optimizers
  from t5x import partitioning as t5x_partitioning
  from t5x import trainer as t5x_trainer
  from t5x import utils as t5x_utils
  import seqio
  from hyperprompt_jax.t5x import t5x_model
  from hyperprompt_jax.tasks import feature_converter

  partitioner = t5x_partitioning.PjitPartitioner(
      num_partitions=1, logical_axis_rules=partitioning.logical_axis_rules())
  # t5x builds its mesh from the slice's chips as on a TPU host.
  partitioner.mesh = t5x_partitioning.get_mesh(
      (1, 1, 1, 1), input_devices=devices, input_local_devices=devices)
  vocabulary = seqio.ByteVocabulary()
  data = t5x_partitioning.PartitionSpec('data')
  shapes = {'encoder_input_tokens': (BATCH, LENGTHS['inputs']),
            'decoder_input_tokens': (BATCH, LENGTHS['targets'])}
  unpacked = {
      'encoder_input_tokens': np.ones(shapes['encoder_input_tokens'],
                                      np.int32),
      **{k: np.ones((BATCH, LENGTHS['targets']), np.int32)
         for k in ('decoder_input_tokens', 'decoder_target_tokens',
                   'decoder_loss_weights')},
      'task_ids': np.zeros((BATCH,), np.int32)}
  packed = {name: np.ones(
      (BATCH, LENGTHS['targets' if name.startswith('decoder') else 'inputs']),
      np.int32) for name in inputs.PACKED_MODEL_FEATURES}

  def compile_step(fn, state_axes, state_shape, batch, train):
    # As t5x's trainer and evaluators partition their steps.
    step = partitioner.partition(
        fn, in_axis_resources=(state_axes, data),
        out_axis_resources=(state_axes, None) if train else None,
        donate_argnums=(0,) if train else ())
    start = time.perf_counter()
    compiled = step.lower(state_shape, batch).compile()
    return _t5x_figures(compiled, time.perf_counter() - start)

  report = {}
  for name in T5X_MODELS + ('unchecked',):
    # The id space of t5x's default run task list (GLUE's 8 tasks).
    config = dataclasses.replace(model_config(
        'hyperprompt_global' if name == 'unchecked' else name), num_tasks=8)
    kwargs = ({} if name != 'unchecked' else dict(
        feature_converter_cls=feature_converter.TaskIdsEncDecFeatureConverter))
    model = t5x_model.TaskIdsEncoderDecoderModel(
        module=network.Transformer(config), input_vocabulary=vocabulary,
        output_vocabulary=vocabulary,
        optimizer_def=t5x_optimizers.OptaxWrapper(
            optimizers.make_optimizer()),
        decode_fn=t5x_decoding.beam_search, **kwargs)
    initializer = t5x_utils.TrainStateInitializer(
        optimizer_def=model.optimizer_def,
        init_fn=model.get_initial_variables, input_shapes=shapes,
        partitioner=partitioner)
    state_shape = initializer.global_train_state_shape
    state_axes = initializer.train_state_axes

    def train_step(state, batch, model=model):
      return t5x_trainer.train_with_lr(
          state, batch, learning_rate=1e-3,
          dropout_rng=jax.random.PRNGKey(0), model=model,
          num_microbatches=None)

    def eval_step(state, batch, model=model):
      return model.eval_fn(state.params, batch)

    def predict_step(state, batch, model=model):
      return model.predict_batch_with_aux(state.params, batch,
                                          num_decodes=2)[0]

    steps = [('train', train_step, packed, True)]
    if name != 'unchecked':
      steps.append(('eval', eval_step, unpacked, False))
    if name in T5X_PREDICTED:
      steps.append(('predict', predict_step, unpacked, False))
    for kind, fn, batch, train in steps:
      key = f'{name}/{kind}/data4'
      try:
        report[key] = compile_step(fn, state_axes, state_shape, batch, train)
      except Exception as e:  # pylint: disable=broad-except
        report[key] = {'error': f'{type(e).__name__}: {e}'}
      print('t5x', key, report[key].get('compile_s'), flush=True)
  return report


def _t5x_figures(compiled, seconds: float) -> dict:
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0]
  return {'compile_s': seconds,
          'argument_bytes': memory.argument_size_in_bytes,
          'temp_bytes': memory.temp_size_in_bytes,
          'flops': cost.get('flops'),
          'bytes_accessed': cost.get('bytes accessed'),
          'host_callbacks': host_callbacks(compiled.as_text())}


def main(out_path: str, names=None) -> None:
  devices = topologies.get_topology_desc(
      platform='tpu', topology_name=TOPOLOGY).devices
  if names == ['--t5x']:  # t5x's steps only
    with open(out_path, 'w') as f:
      json.dump({'topology': TOPOLOGY, 't5x': t5x_programs(devices)}, f,
                indent=1)
    return
  report = {'topology': TOPOLOGY, 'meshes': MESHES, 'batch': BATCH,
            'controls': controls(devices), 'programs': {}}
  for name, kind, mesh_name in programs():
    if names and name not in names:
      continue
    key = f'{name}/{kind}/{mesh_name}'
    build = train_step if kind == 'train' else decode
    try:
      report['programs'][key] = build(name, mesh_of(devices,
                                                     *MESHES[mesh_name]))
    except Exception as e:  # pylint: disable=broad-except
      report['programs'][key] = {'error': f'{type(e).__name__}: {e}'}
    print(key, report['programs'][key].get('compile_s'), flush=True)
    with open(out_path, 'w') as f:  # a run cut short keeps its part
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:] or None)
