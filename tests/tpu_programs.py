"""Compiles the tiny model of every method for TPU slices, without a TPU.

Run as a script by `test_tpu_compile.py` (`python tests/tpu_programs.py
OUT.json` for every model, `OUT.json --part=NAME` for the models of one of
`PARTS`, or `OUT.json --t5x` for t5x's steps), so that libtpu loads in a
process of its own. With libtpu installed (the `[test]` and `[tpu]`
extras), `jax.experimental.topologies` gives a slice's devices on a
CPU-only machine and `jit(...).lower(...).compile()` compiles for them: the
TPU compiler's own program, memory and cost figures.

Programs, each as the built-in runner builds it (`benchmarks.tpu_compile`,
the compile command's own functions): the training step of
`runner.trainer.Trainer` (packed rows, the runner's shardings, checked on
the host) of every method and the greedy decode of
`evaluation.predictor.Predictor` of one model per conditioning path, on a
`v5e:2x2` slice: the batch split two ways over 'data' and the parameters
over a 'model' axis of 2 (all), and the batch split four ways (`BOTH_MESHES`).
With `--t5x`, t5x's train, eval and predict steps (`t5x_programs`); with
`--t5x_run`, a t5x run file through the compile command (`t5x_runs`).

Per program the JSON holds `program_figures.figures`: the compile time, the
memory, FLOPs and bytes accessed, the host transfers and callback custom
calls left in the optimized module (`host_callbacks`), and each argument's
per-chip shard (`arguments`: shape, dtype, the shard's shape, the tiled
shape as the compiler lays it out, a parameter's logical axes), which the
test sums.
"""

import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no TPU host metadata here
# Compiling only: no TPU is opened, so libtpu's one-process lock need not
# keep another compiling process out.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

# pylint: disable=g-import-not-at-top
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np

import conftest
from hyperprompt_jax.benchmarks import tpu_compile
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.methods import adapters
from hyperprompt_jax.methods import hyperformer
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import inputs
from hyperprompt_jax.t5 import task_blocks
from hyperprompt_jax.t5 import traced_mesh
from hyperprompt_jax.tpu import program_figures
from hyperprompt_jax.tpu import slices
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer as trainer_lib

TOPOLOGY = 'v5e:2x2'
# (data, model) axes of the meshes over the slice's 4 chips.
MESHES = {'data4': (4, 1), 'data2_model2': (2, 2)}
BATCH = 8  # rows: divisible by every mesh's data axis
LENGTHS = {'inputs': 16, 'targets': 8}


def _hypergrid(variant, form='auto'):
  return dict(num_tasks=4, hypergrid=hypergrid.HyperGridConfig(
      variant=variant, grid_rows=4, grid_cols=8, max_segments=4,
      packed_form=form))


def _hyperprompt(variant, form='auto'):
  return dict(hyperprompt=dataclasses.replace(conftest.TINY_GLOBAL_PROMPTS,
                                              variant=variant,
                                              packed_form=form))


# Every method of `methods.REGISTRY` at the tiny size (conftest's t5x test
# configuration), HyperPrompt, HyperGrid and the adapter in every packed form.
MODELS = {
    'mtl': {},
    'hyperprompt_share': _hyperprompt('share'),
    'hyperprompt_sep': _hyperprompt('sep'),
    'hyperprompt_global': _hyperprompt('global'),
    'hyperprompt_global_task_blocks': _hyperprompt('global', 'task_blocks'),
    # The variants differ in their gates, the forms in the packed matmul:
    # every variant in the default form (on TPU the kernel, 'pallas'), one
    # in the others.
    **{f'hypergrid_{v}': _hypergrid(v) for v in ('l', 'l2', 'lg', 'gl')},
    'hypergrid_lg_blockwise': _hypergrid('lg', 'blockwise'),
    'hypergrid_lg_grouped': _hypergrid('lg', 'grouped'),
    'output_gating': _hypergrid('output_gating'),
    'adapter': dict(adapter=adapters.AdapterConfig(reduction=8)),
    'adapter_task_blocks': dict(adapter=adapters.AdapterConfig(
        reduction=8, packed_form='task_blocks')),
    'hyperformer_pp': dict(hyperformer=hyperformer.HyperFormerConfig(
        reduction=8, task_embed_dim=8, task_hidden_dim=16, projected_dim=8)),
    'prompt_tuning': dict(prompt_tuning=prompt_tuning.PromptTuningConfig(
        prompt_length=3)),
}
# The decode of one model of each conditioning path (HyperGrid's forms
# differ in packed training only).
DECODED = ('mtl', 'hyperprompt_global', 'hypergrid_lg',
           'output_gating', 'adapter', 'hyperformer_pp', 'prompt_tuning')
# Compiled on both meshes; every other program on 'data2_model2' only, whose
# batch is split too (a TPU compile takes ~5-15 s a step here).
BOTH_MESHES = ('mtl', 'hypergrid_lg', 'hypergrid_lg_grouped')
# `MODELS` in parts of about equal compile time (~110 s each on a loaded
# 2-core host), each compiled in a process of its own (`--part=NAME`), so
# that a test of each part runs beside the others under pytest-xdist; the
# controls are compiled with the part that holds MTL, whose step they take.
PARTS = {
    'mtl_hyperprompt': ('mtl', 'hyperprompt_share', 'hyperprompt_sep',
                        'hyperprompt_global',
                        'hyperprompt_global_task_blocks'),
    'hypergrid': ('hypergrid_l', 'hypergrid_l2', 'hypergrid_lg',
                  'hypergrid_gl', 'hypergrid_lg_blockwise',
                  'hypergrid_lg_grouped'),
    'gates_adapters_prompts': ('output_gating', 'adapter',
                               'adapter_task_blocks', 'hyperformer_pp',
                               'prompt_tuning'),
}
CONTROLS_PART = 'mtl_hyperprompt'


def programs(names=None) -> list[tuple[str, str, str]]:
  """`(model, 'train' | 'decode', mesh)` of every program compiled (of the
  models `names`, by default all)."""
  out = []
  for name in MODELS:
    if names is not None and name not in names:
      continue
    for mesh in (MESHES if name in BOTH_MESHES else ('data2_model2',)):
      out.append((name, 'train', mesh))
      if name in DECODED:
        out.append((name, 'decode', mesh))
  return out


def model_config(name: str) -> network.T5Config:
  """The tiny model with one layer a stack (a TPU compile's time grows
  with the layers; one holds every path of the method)."""
  return dataclasses.replace(conftest.T5X_TINY_CONFIG, num_encoder_layers=1,
                             num_decoder_layers=1, **MODELS[name])


def _setup(name: str) -> tpu_compile.Setup:
  return tpu_compile.Setup(
      name=name, config=model_config(name), input_length=LENGTHS['inputs'],
      target_length=LENGTHS['targets'], batch_size=BATCH, pack=True,
      eval_batch_size=BATCH)


def train_step(name: str, mesh: jax.sharding.Mesh) -> dict:
  """The built-in runner's training step on packed rows."""
  return tpu_compile.compile_train(_setup(name), mesh, None)


def decode(name: str, mesh: jax.sharding.Mesh) -> dict:
  """The evaluator's greedy decode (`Predictor`)."""
  return tpu_compile.compile_decode(_setup(name), mesh, None)


def controls(devices) -> dict:
  """What the checks are measured against: the host callback of a program
  that has one, as `host_callbacks` finds it; and the training step with
  the network's in-graph task-id check (`checked_on_host=False`, a host
  callback) on a split batch: the error of its compile, if any."""
  mesh = partitioning.create_mesh(1, 1, devices=devices[:1])

  def with_callback(x):
    jax.debug.callback(lambda v: None, x.max())
    return x * 2

  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.NamedSharding(
                               mesh, jax.sharding.PartitionSpec()))
  found = program_figures.host_callbacks(
      jax.jit(with_callback).lower(x).compile().as_text())
  model = network.Transformer(model_config('mtl'))
  mesh = partitioning.create_mesh(*MESHES['data4'], devices=devices)
  trainer = trainer_lib.Trainer(model, optimizers.make_optimizer(), mesh,
                                LENGTHS, checked_on_host=False)
  try:
    with jax.set_mesh(mesh):
      trainer.step_function().lower(
          trainer.abstract_state(),
          tpu_compile.placed_batch(inputs.PACKED_MODEL_FEATURES, BATCH,
                                   LENGTHS, trainer.batch_sharding)).compile()
    in_graph_check = None
  except Exception as e:  # pylint: disable=broad-except
    in_graph_check = f'{type(e).__name__}: {e}'
  # The forms 'auto' picks where the model is compiled for the slice.
  with jax.set_mesh(mesh):
    forms = {'platform': traced_mesh.target_platform(),
             'gradient_form': task_blocks.resolve_gradient_form('auto'),
             'packed_form': hypergrid.resolve_packed_form('auto'),
             'adapter_form': adapters.resolve_packed_form('auto'),
             'prompt_form': hyperprompt.resolve_packed_form('auto')}
  return {'callback_found': found, 'in_graph_check_error': in_graph_check,
          'auto_forms': forms}


# t5x's programs (`t5x_programs`): the training step of each variant on
# packed rows, its eval loss and beam search on unpacked ones.
T5X_VARIANTS = ('hyperprompt_global', 'hypergrid_lg')
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
    return program_figures.figures(compiled, time.perf_counter() - start)

  report = {}
  for name in T5X_VARIANTS + ('unchecked',):
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


def mtl_and_t5x_network(devices) -> dict:
  """The training step of MTL (the project's network) and of t5x's
  `examples/t5` network at T5.1.1-small, bf16, batch 32 of 512 / 32 split
  four ways, parameters replicated: the same token cross-entropy with
  z-loss and a plain SGD update around each, compiled for the slice."""
  from t5x.examples.t5 import network as t5x_network  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.benchmarks import mfu  # pylint: disable=g-import-not-at-top
  size = mfu.BACKBONES['t5_1_1_small']
  batch, lengths = 32, (512, 32)
  models = {
      'mtl': network.Transformer(network.T5Config(
          **size, dtype='bfloat16', check_traced_task_ids=False)),
      't5x': t5x_network.Transformer(t5x_network.T5Config(
          **size, dtype='bfloat16')),  # the same fields
  }
  mesh = partitioning.create_mesh(-1, 1, devices=devices)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))

  def call(name, params, *tokens):
    task_ids = {'task_ids': jnp.zeros(tokens[0].shape[:1], jnp.int32)}
    return models[name].apply({'params': params}, *tokens,
                              enable_dropout=False,
                              **(task_ids if name == 'mtl' else {}))

  def step(name, params, inputs, decoder_inputs, targets):
    def loss(params):
      logits = call(name, params, inputs, decoder_inputs, targets).astype(
          jnp.float32)
      log_z = jax.nn.logsumexp(logits, axis=-1)
      picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
      return (log_z - picked + 1e-4 * log_z**2).mean()
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params,
                        jax.grad(loss)(params))

  report = {}
  for name in models:
    one = [jnp.ones((1, n), jnp.int32) for n in (lengths[0], lengths[1],
                                                  lengths[1])]
    params = jax.eval_shape(
        lambda name=name: models[name].init(jax.random.PRNGKey(0), *one, **(
            {'task_ids': jnp.zeros((1,), jnp.int32)} if name == 'mtl'
            else {}), enable_dropout=False))['params']
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=replicated), params)
    tokens = [jax.ShapeDtypeStruct((batch, n), jnp.int32, sharding=rows)
              for n in (lengths[0], lengths[1], lengths[1])]
    start = time.perf_counter()
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(
        partitioning.logical_axis_rules()):
      compiled = jax.jit(functools.partial(step, name), donate_argnums=(0,)
                         ).lower(params, *tokens).compile()
    report[name] = program_figures.figures(compiled, time.perf_counter() - start)
    report[name].pop('largest')
  return report


# `--t5x_run`: t5x's quickstart run file (`t5x/quickstart_train.gin`) made
# smaller still (one layer a stack, 8 rows of 32 / 8 tokens), compiled by
# the compile command's `hyperprompt_jax.t5x.steps_compile.compile_run` on each
# slice with each partitioner setting: `v5e-4` has no t5x default mesh, so
# its model axis is the submesh; `v3-8` takes t5x's `num_partitions` table.
T5X_RUN_BINDINGS = ('network.T5Config.num_encoder_layers=1',
                    'network.T5Config.num_decoder_layers=1', 'BATCH_SIZE=8',
                    "TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}")
T5X_RUNS = {
    'v5e-4/submesh1': ('v5e-4', ('MESH_MODEL=None',
                                 'partitioning.PjitPartitioner.'
                                 'model_parallel_submesh=(1, 1, 1, 1)')),
    'v5e-4/submesh2': ('v5e-4', ('MESH_MODEL=None',
                                 'partitioning.PjitPartitioner.'
                                 'model_parallel_submesh=(1, 2, 1, 1)')),
    'v5e-4/num_partitions1': ('v5e-4', ('MESH_MODEL=1',)),
    'v3-8/num_partitions2': ('v3-8', ('MESH_MODEL=2',)),
}


def t5x_runs() -> dict:
  """Each of `T5X_RUNS` compiled by the compile command's t5x path: its
  setup report, or the error that stopped it."""
  from hyperprompt_jax.t5x import steps_compile  # pylint: disable=g-import-not-at-top
  report = {}
  devices = {}
  for key, (topology, bindings) in T5X_RUNS.items():
    if topology not in devices:
      devices[topology] = slices.topology_devices(topology)
    run = steps_compile.T5xRun(
        name='quickstart_train', gin_files=['t5x/quickstart_train.gin'],
        bindings=list(T5X_RUN_BINDINGS + bindings), predict_batch_size=8)
    try:
      report[key] = steps_compile.compile_run(run, devices[topology])
      report[key]['slice'] = slices.slice_header(topology,
                                                      devices[topology])
    except ValueError as e:
      report[key] = {'error': str(e)}
    print('t5x run', key, flush=True)
  return report


def main(out_path: str, names=None) -> None:
  if names == ['--t5x_run']:
    with open(out_path, 'w') as f:
      json.dump({'t5x_run': t5x_runs()}, f, indent=1)
    return
  devices = slices.topology_devices(TOPOLOGY)
  if names in (['--t5x'], ['--vs_t5x']):  # t5x's steps; MTL against t5x's
    build = t5x_programs if names == ['--t5x'] else mtl_and_t5x_network
    with open(out_path, 'w') as f:
      json.dump({'topology': TOPOLOGY, names[0][2:]: build(devices)}, f,
                indent=1)
    return
  # `--part=NAME`: the models of `PARTS[NAME]` (the controls with
  # `CONTROLS_PART`'s); model names: those; nothing: every model.
  part = None
  if names and names[0].startswith('--part='):
    part = names[0][len('--part='):]
    names = list(PARTS[part])
  report = {'topology': TOPOLOGY, 'meshes': MESHES, 'batch': BATCH,
            'programs': {}}
  if part in (None, CONTROLS_PART):
    report['controls'] = controls(devices)
  for name, kind, mesh_name in programs(names):
    key = f'{name}/{kind}/{mesh_name}'
    build = train_step if kind == 'train' else decode
    try:
      report['programs'][key] = build(name, partitioning.create_mesh(
          *MESHES[mesh_name], devices=devices))
    except Exception as e:  # pylint: disable=broad-except
      report['programs'][key] = {'error': f'{type(e).__name__}: {e}'}
    print(key, report['programs'][key].get('compile_s'), flush=True)
    with open(out_path, 'w') as f:  # a run cut short keeps its part
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:] or None)
