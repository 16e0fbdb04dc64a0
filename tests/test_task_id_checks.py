"""Out-of-range task ids fail loudly at every public entry, traced or not.

Inside `jax.jit` an out-of-range gather clamps (id -1: task T-1's output) or
fills NaN (id 1000), silently; `conditioning.check_task_ids` makes the
compiled program raise instead (on every platform and mesh: the network's
defaults compile in a user's own `jit` for a TPU slice too), and where every batch is checked on the host
first (the built-in runner's steps and decodes; t5x's steps, whose data
comes through the feature converter) the programs hold no check of their
own.
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import multiprocess
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.model import decoding
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer as trainer_lib

NUM_TASKS = 8  # the default run task list (GLUE) for the t5x model
CFG = dataclasses.replace(
    conftest.T5X_TINY_CONFIG, num_encoder_layers=1, num_decoder_layers=1,
    num_tasks=NUM_TASKS, hyperprompt=hyperprompt.HyperPromptConfig(
        variant='global', encoder_prompt_length=2, decoder_prompt_length=2,
        hypernet_reduction=8, task_embed_dim=4, task_hidden_dim=8,
        layer_task_embed_dim=4))
VALID = np.array([0, 3, 1], np.int32)
# (ids, their range as the error names it)
BAD = [(np.array([0, 1000, 2], np.int32), (0, 1000)),
       (np.array([-1, 1, 2], np.int32), (-1, 2))]


def _out_of_range(low, high, error=jax.errors.JaxRuntimeError):
  """Expects the check's error, naming the ids' range and the valid one."""
  return pytest.raises(error, match=re.escape(
      f'task_ids must lie in [0, num_tasks) = [0, {NUM_TASKS}), got ids '
      f'from {low} to {high}. Raise NUM_TASKS'))


@pytest.fixture(scope='module')
def model_and_params():
  model = network.Transformer(CFG)
  return model, jax.jit(lambda rng: network.init_variables(
      model, rng, batch_size=3)['params'])(jax.random.PRNGKey(0))


def _tokens(seed=0):
  rng = np.random.default_rng(seed)
  enc = conftest.random_tokens(rng, (3, 6), pad_from=[6, 4, 2])
  tgt = conftest.random_tokens(rng, (3, 4), pad_from=[4, 3, 1])
  return enc, conftest.decoder_inputs(tgt), tgt


def _assert_checked(fn):
  """`fn(ids)` runs on valid ids and raises on each out-of-range set."""
  assert np.isfinite(np.asarray(fn(VALID), np.float32)).all()
  for ids, (low, high) in BAD:
    with _out_of_range(low, high):
      jax.block_until_ready(fn(ids))


def test_call_encode_decode_under_jit(model_and_params):
  model, params = model_and_params
  enc, dec_in, tgt = _tokens()
  encoded = model.apply({'params': params}, enc, enable_dropout=False,
                        task_ids=VALID, method=model.encode)
  _assert_checked(jax.jit(lambda ids: model.apply(
      {'params': params}, enc, dec_in, tgt, enable_dropout=False,
      task_ids=ids)))
  _assert_checked(jax.jit(lambda ids: model.apply(
      {'params': params}, enc, enable_dropout=False, task_ids=ids,
      method=model.encode)))
  _assert_checked(jax.jit(lambda ids: model.apply(
      {'params': params}, encoded, enc, dec_in, tgt, enable_dropout=False,
      task_ids=ids, method=model.decode)))


def test_gradient_and_packed_per_token_ids(model_and_params):
  model, params = model_and_params
  enc, dec_in, tgt = _tokens(1)

  def loss(p, ids):
    return model.apply({'params': p}, enc, dec_in, tgt,
                       enable_dropout=False, task_ids=ids).mean()

  grad = jax.jit(jax.grad(loss))
  _assert_checked(lambda ids: grad(params, ids)['decoder']['logits_dense']
                  ['kernel'])
  # Packed rows: one example per row here, ids per token (padding: id 0).
  packed = jax.jit(lambda enc_ids, dec_ids: model.apply(
      {'params': params}, enc, dec_in, tgt, (enc > 0).astype(jnp.int32),
      (tgt > 0).astype(jnp.int32), enable_dropout=False,
      encoder_task_ids=enc_ids, decoder_task_ids=dec_ids))
  per_token = lambda ids, t: np.where(t > 0, ids[:, None], 0)
  _assert_checked(lambda ids: packed(per_token(ids, enc),
                                     per_token(VALID, tgt)))


def test_greedy_decode_and_predictor(model_and_params):
  model, params = model_and_params
  enc, _, _ = _tokens(2)
  greedy = jax.jit(lambda ids: decoding.greedy_decode(model, params, enc,
                                                      ids, 3))
  _assert_checked(greedy)
  # Decode steps alone, against a cache made with valid ids.
  encoded = model.apply({'params': params}, enc, enable_dropout=False,
                        task_ids=VALID, method=model.encode)
  cache = network.create_cache(model, params, encoded, enc, 3, VALID)
  token = jnp.zeros((3, 1), jnp.int32)
  _assert_checked(jax.jit(lambda ids: model.apply(
      {'params': params, 'cache': cache}, encoded, enc, token, token,
      enable_dropout=False, decode=True, max_decode_length=3, task_ids=ids,
      mutable=['cache'], method=model.decode)[0]))
  # The predictor refuses the batch on the host, before its compiled call.
  predictor = predictor_lib.Predictor(
      model, network.abstract_variables(model)['params_axes'],
      partitioning.create_mesh(1, 1), batch_size=3, max_decode_length=3)
  predictor.set_params(params)
  with pytest.raises(ValueError, match='1000'):
    predictor.predict({'encoder_input_tokens': enc, 'task_ids': BAD[0][0]})


def test_ids_as_a_list(model_and_params):
  model, params = model_and_params
  enc, dec_in, tgt = _tokens(3)
  want = model.apply({'params': params}, enc, dec_in, tgt,
                     enable_dropout=False, task_ids=jnp.asarray(VALID))
  got = model.apply({'params': params}, enc, dec_in, tgt,
                    enable_dropout=False, task_ids=VALID.tolist())
  np.testing.assert_array_equal(got, want)  # the same ids, the same program
  with _out_of_range(0, 1000, ValueError):
    model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False,
                task_ids=[0, 1000, 2])
  with pytest.raises(ValueError, match='task_ids must be an int32 array'):
    model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False,
                task_ids=object())


def test_off_switch_leaves_no_callback(model_and_params):
  _, params = model_and_params
  enc, _, _ = _tokens()

  def lowered(check):
    model = network.Transformer(dataclasses.replace(
        CFG, check_traced_task_ids=check))
    return jax.jit(lambda ids: model.apply(
        {'params': params}, enc, enable_dropout=False, task_ids=ids,
        method=model.encode)).lower(VALID).as_text()

  assert 'callback' in lowered(True)
  assert 'callback' not in lowered(False)


def test_programs_of_batches_checked_on_host_hold_no_callback(
    model_and_params):
  """The built-in runner's steps and the predictor's decodes get batches
  checked on the host, and initialisation is traced on concrete
  placeholders: their programs hold no host callback, which JAX's
  persistent compilation cache would refuse to keep."""
  model, params = model_and_params
  enc, dec_in, tgt = _tokens()
  mesh = partitioning.create_mesh(1, 1)

  def step_text(checked_on_host):
    trainer = trainer_lib.Trainer(
        model, optimizers.make_optimizer(), mesh, {'inputs': 6, 'targets': 4},
        checked_on_host=checked_on_host)
    batch = {'encoder_input_tokens': enc, 'decoder_input_tokens': dec_in,
             'decoder_target_tokens': tgt,
             'decoder_loss_weights': (tgt > 0).astype(np.float32),
             'task_ids': VALID}
    with jax.set_mesh(mesh):
      return jax.jit(trainer._step).lower(  # pylint: disable=protected-access
          trainer.abstract_state(), batch).as_text()

  assert 'callback' in step_text(False)
  assert 'callback' not in step_text(True)
  predictor = predictor_lib.Predictor(
      model, network.abstract_variables(model)['params_axes'], mesh,
      batch_size=3, max_decode_length=3)
  assert 'callback' not in predictor._decode.lower(  # pylint: disable=protected-access
      params, enc, VALID).as_text()
  # Every fresh run's initialisation: its placeholder ids are concrete.
  assert 'callback' not in jax.jit(
      lambda rng: network.init_variables(model, rng)).lower(
          jax.random.PRNGKey(0)).as_text()


# ----------------------------------------- on the host: the t5x data path --

def _examples(ids) -> 'tf.data.Dataset':
  """One seqio example per task id: inputs of 3 + i tokens, 2 targets."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def generate():
    for i, task_id in enumerate(ids):
      yield {'inputs': np.arange(1, 4 + i, dtype=np.int32),
             'targets': np.array([5, 6], np.int32),
             'task_ids': np.int32(task_id)}

  spec = tf.TensorSpec([None], tf.int32)
  return tf.data.Dataset.from_generator(generate, output_signature={
      'inputs': spec, 'targets': spec,
      'task_ids': tf.TensorSpec([], tf.int32)})


@pytest.mark.parametrize('pack', [False, True])
def test_feature_converter_checks_task_ids_on_the_host(pack):
  """The converter t5x builds every dataset through refuses an example whose
  id leaves `[0, num_tasks)` when the input pipeline reaches it, before
  any batch holding it exists; valid examples pass unchanged."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.tasks import feature_converter  # pylint: disable=g-import-not-at-top

  lengths = {'inputs': 16, 'targets': 8}

  def rows(ids, **kwargs):
    converter = feature_converter.TaskIdsEncDecFeatureConverter(
        pack=pack, **kwargs)
    return list(converter(_examples(ids), lengths).as_numpy_iterator())

  valid = [0, 3, 1, 2]
  got, want = rows(valid, num_tasks=4), rows(valid)
  assert len(got) == len(want) > 0
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for k in g:
      np.testing.assert_array_equal(g[k], w[k])
  for bad in (4, -1):
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(
        f'task_ids must lie in [0, num_tasks) = [0, 4), got id {bad}. '
        'Raise NUM_TASKS (T5Config.num_tasks) or fix the task list.')):
      rows([0, bad, 1], num_tasks=4)


def test_feature_converter_says_what_it_checks():
  """`checks(num_tasks, max_examples)`: ids checked against a space no
  larger than the model's, and packed rows closed at the model's bound."""
  from hyperprompt_jax.tasks import feature_converter  # pylint: disable=g-import-not-at-top

  converter = feature_converter.TaskIdsEncDecFeatureConverter
  assert converter(num_tasks=4).checks(4, None)
  assert converter(num_tasks=4).checks(8, 2)  # unpacked: one example a row
  assert not converter(num_tasks=8).checks(4, None)
  assert not converter().checks(4, None)
  assert not converter(pack=True, num_tasks=4).checks(4, 8)
  assert converter(pack=True, num_tasks=4,
                   max_examples_per_row=4).checks(4, 8)
  assert not converter(pack=True, num_tasks=4,
                       max_examples_per_row=8).checks(4, 4)
  with pytest.raises(ValueError, match='num_tasks must be None or an int'):
    converter(num_tasks=0)


def _t5x_model(**kwargs):
  from t5x import optimizers as t5x_optimizers  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.t5x import t5x_model  # pylint: disable=g-import-not-at-top

  vocabulary = seqio.ByteVocabulary()
  return t5x_model.TaskIdsEncoderDecoderModel(
      module=network.Transformer(CFG), input_vocabulary=vocabulary,
      output_vocabulary=vocabulary,
      optimizer_def=t5x_optimizers.OptaxWrapper(optimizers.make_optimizer()),
      **kwargs)


def _t5x_batch():
  enc, dec_in, tgt = _tokens(4)
  return {'encoder_input_tokens': enc, 'decoder_input_tokens': dec_in,
          'decoder_target_tokens': tgt,
          'decoder_loss_weights': (tgt > 0).astype(np.int32)}


def test_t5x_steps_take_batches_checked_by_the_converter(model_and_params):
  """t5x's steps of the adapter hold no host callback (which would keep
  them out of JAX's compilation cache and off its fast dispatch): its
  feature converter, which builds every dataset of a t5x run, checks the
  ids on the host instead."""
  pytest.importorskip('t5x')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  model = _t5x_model()
  assert not model.module.config.check_traced_task_ids
  params = model_and_params[1]  # get_initial_variables' (init_variables)
  batch = _t5x_batch()
  for fn in (lambda ids: model.loss_fn(params, dict(batch, task_ids=ids),
                                       None)[0],
             lambda ids: model.predict_batch_with_aux(
                 params, dict(batch, task_ids=ids), num_decodes=1)[1][
                     'scores']):
    assert 'callback' not in jax.jit(fn).lower(VALID).as_text()
  converter = model.FEATURE_CONVERTER_CLS(pack=False)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=re.escape(f'[0, {NUM_TASKS}), got id 1000')):
    list(converter(_examples([0, 1000]), {'inputs': 16, 'targets': 8}))


def test_t5x_with_an_unchecking_converter_keeps_the_in_graph_check(
    model_and_params):
  """A converter that does not check the ids (no `num_tasks`) leaves the
  network's own check in t5x's steps: a bad id still fails the call."""
  pytest.importorskip('t5x')
  from hyperprompt_jax.tasks import feature_converter  # pylint: disable=g-import-not-at-top

  model = _t5x_model(
      feature_converter_cls=feature_converter.TaskIdsEncDecFeatureConverter)
  assert model.module.config.check_traced_task_ids
  params = model_and_params[1]
  batch = _t5x_batch()
  loss = jax.jit(lambda ids: model.loss_fn(params, dict(batch, task_ids=ids),
                                           None)[0])
  _assert_checked(loss)
  predict = jax.jit(lambda ids: model.predict_batch_with_aux(
      params, dict(batch, task_ids=ids), num_decodes=1)[1]['scores'])
  _assert_checked(predict)


# ------------------- any program, any platform: the network's defaults --

# The default network of a method (`T5Config.check_traced_task_ids` on, as
# gin leaves it): the tiny model with the method's variant file, one layer a
# stack. HyperGrid gates per example, so its packed rows carry the segment
# check too (at most MAX_SEGMENTS examples a row).
HYPERGRID_BINDINGS = ('GRID_ROWS = 4', 'GRID_COLS = 8', 'MAX_SEGMENTS = 2')
# A user's own program: `jit` of the loss gradient, the parameters
# replicated and the rows split over 'data' of a mesh ('data' alone, or
# 'data' x 'model' of 2), given by the inputs' shardings, outside a mesh
# context or inside one (`with mesh:`, `jax.set_mesh`). Run as a script,
# so that it can have its own devices: prints one `RESULT {json}` a case.
_GRADIENT = r'''
import json
import sys

import gin
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.model import network
from hyperprompt_jax.tpu import program_figures
from hyperprompt_jax.tpu import slices

ROWS, INPUTS, TARGETS = 8, 16, 8
CASES = json.loads(sys.argv[1])


def build(variant, bindings):
  gin.clear_config()
  gin_utils.parse_gin(
      ['models/t5_1_1_tiny.gin', f'variants/{variant}.gin'],
      ['network.T5Config.num_encoder_layers = 1',
       'network.T5Config.num_decoder_layers = 1', *bindings])
  return gin.get_configurable(network.Transformer)()


def rows(ids, packed, segments):
  """The model's inputs: unpacked, or each row `segments` examples of
  task `ids[row]` (per-token ids)."""
  rng = np.random.default_rng(0)
  enc = rng.integers(1, 300, (ROWS, INPUTS), dtype=np.int32)
  tgt = rng.integers(1, 300, (ROWS, TARGETS), dtype=np.int32)
  x = dict(encoder_input_tokens=enc, decoder_target_tokens=tgt,
           decoder_input_tokens=np.pad(tgt[:, :-1], ((0, 0), (1, 0))))
  if not packed:
    return dict(x, task_ids=np.asarray(ids, np.int32))
  for side, length in (('encoder', INPUTS), ('decoder', TARGETS)):
    x[f'{side}_segment_ids'] = np.broadcast_to(
        1 + np.arange(length) * segments // length, (ROWS, length)
    ).astype(np.int32)
    x[f'{side}_task_ids'] = np.broadcast_to(
        np.asarray(ids, np.int32)[:, None], (ROWS, length))
  return x


def gradient(model):
  def loss(params, x):
    return model.apply({'params': params}, **x, enable_dropout=False).mean()
  return jax.jit(jax.grad(loss))


def failure(fn):
  """`fn()`'s error, or None when it returns."""
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    return f'{type(e).__name__}: {e}'
  return None


def in_context(context, mesh, fn):
  if context == 'with_mesh':
    with mesh:
      return fn()
  if context == 'set_mesh':
    with jax.set_mesh(mesh):
      return fn()
  return fn()


for case in CASES:
  devices = (jax.devices() if case['topology'] == 'cpu'
             else slices.topology_devices(case['topology']))
  model = build(case['variant'], case['bindings'])
  axes = tuple(case['axes'])
  mesh = Mesh(np.array(devices).reshape(
      (len(devices),) if axes == ('data',) else (len(devices) // 2, 2)), axes)
  split, whole = NamedSharding(mesh, P('data')), NamedSharding(mesh, P())
  grad = gradient(model)
  params = jax.eval_shape(lambda: network.init_variables(
      model, jax.random.PRNGKey(0))['params'])
  valid = np.arange(ROWS) % model.config.num_tasks
  packed = case['packed']
  result = dict(case)
  if case['topology'] != 'cpu':  # compile only: no TPU here
    try:
      compiled = in_context(case['context'], mesh, lambda: grad.lower(
          jax.tree.map(lambda a: jax.ShapeDtypeStruct(
              a.shape, a.dtype, sharding=whole), params),
          jax.tree.map(lambda a: jax.ShapeDtypeStruct(
              a.shape, a.dtype, sharding=split),
              rows(valid, packed, 2))).compile())
      result['host_callbacks'] = len(program_figures.host_callbacks(
          compiled.as_text()))
    except Exception as e:  # pylint: disable=broad-except
      result['error'] = f'{type(e).__name__}: {e}'
  else:
    params = jax.device_put(jax.jit(lambda: network.init_variables(
        model, jax.random.PRNGKey(0))['params'])(), whole)

    def run(ids, segments=2):
      x = jax.device_put(rows(ids, packed, segments), split)
      return in_context(case['context'], mesh, lambda: jax.block_until_ready(
          grad(params, x)))

    run(valid)
    bad = {'id 1000': valid.copy(), 'id -1': valid.copy()}
    bad['id 1000'][ROWS - 1] = 1000  # on the last device's rows
    bad['id -1'][ROWS // 2] = -1
    result['errors'] = {name: failure(lambda ids=ids: run(ids))
                        for name, ids in bad.items()}
    if packed:
      result['errors']['3 segments'] = failure(lambda: run(valid, 3))
  print('RESULT', json.dumps(result), flush=True)
'''


needs_libtpu = conftest.needs_libtpu


def _case(topology, variant, axes, context, bindings=(), packed=False
          ) -> dict:
  """One program of `_GRADIENT`, compiled for a TPU slice's `topology`
  (`jax.experimental.topologies`) or run on 'cpu'."""
  return dict(topology=topology, variant=variant, bindings=list(bindings),
              axes=list(axes), context=context, packed=packed)


def _gradients(cases: list[dict], env: dict) -> list[dict]:
  """Runs `_GRADIENT` in a process of its own (its CPU devices as `env`
  sets them); its results, one a case."""
  run = subprocess.run(
      [sys.executable, '-c', _GRADIENT, json.dumps(cases)],
      cwd=pathlib.Path(__file__).parent, env=env, capture_output=True,
      text=True, timeout=600, check=False)
  results = [json.loads(line[len('RESULT '):])
             for line in run.stdout.splitlines()
             if line.startswith('RESULT ')]
  assert run.returncode == 0 and len(results) == len(cases), (
      run.stdout[-2000:] + run.stderr[-4000:])
  return results


@needs_libtpu
def test_default_networks_compile_for_tpu_slices():
  """Every method's default network (the in-graph check on) in a plain
  `jit` of its gradient, the batch split over a TPU slice's devices,
  compiles for the slice, with its check's host callback (on the TPU, a
  callback of the program's first device: the TPU compiler takes no
  partitioned one)."""
  v5e, v3 = 'v5e:2x2', 'v3:2x2'
  cases = [
      *[_case(v5e, 'hyperprompt_global', axes, context)
        for axes in (('data',), ('data', 'model'))
        for context in ('none', 'with_mesh', 'set_mesh')],
      _case(v5e, 'hypergrid_lg', ('data', 'model'), 'with_mesh',
            HYPERGRID_BINDINGS, packed=True),
      _case(v5e, 'adapter', ('data',), 'none'),
      _case(v5e, 'hyperformer_pp', ('data', 'model'), 'with_mesh'),
      _case(v3, 'hyperprompt_global', ('data', 'model'), 'none'),
      _case(v3, 'hypergrid_lg', ('data',), 'none', HYPERGRID_BINDINGS,
            packed=True)]
  env = dict(os.environ, TPU_SKIP_MDS_QUERY='1',
             ALLOW_MULTIPLE_LIBTPU_LOAD='1')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # TPU programs: not the CPU's
  for result in _gradients(cases, env):
    assert 'error' not in result, result
    assert result['host_callbacks'] > 0, result


def test_checks_fail_the_call_on_a_cpu_mesh_with_the_batch_split():
  """On 8 CPU devices, the rows split over them: an out-of-range id or a
  row of too many examples fails the call with the project's message (every
  device fails alike: no device waits at a collective for one that
  stopped)."""
  cases = [_case('cpu', 'hyperprompt_global', ('data',), 'none'),
           _case('cpu', 'hyperprompt_global', ('data', 'model'), 'with_mesh'),
           _case('cpu', 'hypergrid_lg', ('data', 'model'), 'none',
                 HYPERGRID_BINDINGS, packed=True)]
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=multiprocess.xla_flags(8))
  for result in _gradients(cases, env):
    errors = result['errors']
    for name, (low, high) in (('id 1000', (0, 1000)), ('id -1', (-1, 7))):
      assert (f'task_ids must lie in [0, num_tasks) = [0, 8), got ids from '
              f'{low} to {high}. Raise NUM_TASKS') in (
                  errors.pop(name) or ''), result
    if result['packed']:
      assert 'holds segment ids up to 3, over MAX_SEGMENTS=2' in (
          errors.pop('3 segments') or ''), result
    assert not errors
