"""The built-in runner: exact resume after SIGKILL and SIGTERM, restoring
real t5x checkpoints, sharding, and clear errors on bad input."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import gin
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from hyperprompt_jax.checkpointing import initial_checkpoint
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.tasks import packing
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import trainer as trainer_lib

import conftest
import multiprocess

LENGTHS = {'inputs': 128, 'targets': 16}
# A quick run of the quickstart: tiny model (one encoder and one decoder
# layer: a resume restores every layer alike, and each process traces and
# steps half the layers), small batch, frequent saves, no evaluation
# (tests/test_train_loop.py evaluates), GLUE's 8 tasks (a mixture, whose
# sampling a resume must continue exactly; each process builds its input
# pipeline in half the time of the 16 tasks').
QUICK = ['--gin_file=runs/quickstart.gin', '--gin.BATCH_SIZE=4',
         '--gin.LOG_PERIOD=4', '--gin.SAVE_PERIOD=4',
         '--gin.KEEP_CHECKPOINTS=None', '--gin.EVAL_PERIOD=None',
         "--gin.MIXTURE_OR_TASK_NAME='fixture_glue_proportional'",
         '--gin.network.T5Config.num_encoder_layers=1',
         '--gin.network.T5Config.num_decoder_layers=1']


def _train_cmd(model_dir, steps, *extra):
  return [sys.executable, '-m', 'hyperprompt_jax.train', *QUICK,
          f'--gin.MODEL_DIR="{model_dir}"', f'--gin.TRAIN_STEPS={steps}',
          *extra]


def _saved_params(model_dir, step) -> dict:
  path = pathlib.Path(model_dir) / f'checkpoint_{step}' / 'state'
  state = ocp.StandardCheckpointer().restore(path)
  return {k: np.asarray(v) for k, v in
          traverse_util.flatten_dict(state['params'], sep='/').items()}


def _env():
  return dict(os.environ, JAX_PLATFORMS='cpu')


def _start(model_dir, steps, wait_for):
  """Starts a run and returns it once `model_dir/wait_for` exists (orbax
  renames a checkpoint into place when it is complete)."""
  proc = subprocess.Popen(_train_cmd(model_dir, steps), env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  deadline = time.time() + 300
  while not (model_dir / wait_for).exists():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.02)
  return proc


def _straight_run_terminated_while_saving_its_last_checkpoint(run, steps):
  """An uninterrupted run of `steps` steps, sent SIGTERM while its last
  checkpoint is written: the final save is asynchronous; the signal is
  recorded, the save committed and the run ends normally."""
  proc = subprocess.Popen(_train_cmd(run, steps), env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if f'Saving {run}/checkpoint_{steps}' in line:
      proc.send_signal(signal.SIGTERM)
      break
  out = ''.join(lines) + proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  assert 'Received SIGTERM' in out, out[-3000:]
  assert f'Finished at step {steps}' in out, out[-3000:]
  assert (run / f'checkpoint_{steps}' / 'state').is_dir()
  assert not list(run.glob('*.orbax-checkpoint-tmp*'))
  assert not (run / 'train.lock').exists()
  # What a resume reads first (`Already at TRAIN_STEPS` follows from it:
  # tests/test_faults.py).
  assert run_record.read(str(run / f'checkpoint_{steps}'))


def test_killed_and_terminated_runs_resume_to_the_uninterrupted_parameters(
    tmp_path):
  """SIGKILL loses the steps since the last checkpoint; SIGTERM (a
  preemption) saves at the next step and exits 128 + 15; either way the
  resumed run ends with the uninterrupted run's parameters, bit for bit.
  The uninterrupted run itself gets a SIGTERM while its last checkpoint is
  written, and keeps it."""
  steps = 24
  straight = tmp_path / 'straight'
  _straight_run_terminated_while_saving_its_last_checkpoint(straight, steps)

  run = tmp_path / 'run'
  proc = _start(run, steps, 'checkpoint_8')
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert not (run / f'checkpoint_{steps}').exists(), 'killed too late'

  # The killed run's lock is stale (its pid is gone): taken over.
  proc = _start(run, steps, 'checkpoint_12')
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  stopped = re.search(r'Stopped by SIGTERM at step (\d+) with '
                      r'checkpoint_(\d+) saved', out)
  assert stopped, out[-3000:]
  at = int(stopped[1])
  assert 12 <= at < steps, 'terminated too late to test resume'
  newest = max(int(p.name.split('_')[1]) for p in run.glob('checkpoint_*'))
  assert newest == at
  assert not (run / 'train.lock').exists()

  out = subprocess.run(_train_cmd(run, steps), check=True, env=_env(),
                       capture_output=True, text=True, timeout=600)
  assert f'Resuming from {run}/checkpoint_{at}' in out.stdout, out.stdout
  want, got = _saved_params(straight, steps), _saved_params(run, steps)
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# --------------------------------------------------------- t5x checkpoints --

def _global_tiny_config(**overrides):
  cfg = dict(vars(conftest.T5X_TINY_CONFIG))
  cfg.update(num_tasks=16, hyperprompt=conftest.TINY_GLOBAL_PROMPTS)
  cfg.update(overrides)
  return network.T5Config(**cfg)


def _trainer(config, mesh=None):
  mesh = mesh or partitioning.create_mesh()
  return trainer_lib.Trainer(network.Transformer(config),
                             optimizers.make_optimizer(), mesh, LENGTHS)


@pytest.mark.parametrize('layout,npz', [
    ('orbax/checkpoint_100', 'orbax_checkpoint_100.params.npz'),
    ('legacy/checkpoint_50', 'legacy_checkpoint_50.params.npz')])
def test_t5x_checkpoint_restores_into_hyperprompt_global(layout, npz):
  trainer = _trainer(_global_tiny_config())
  params, fresh, _ = initial_checkpoint.params_from_t5x(
      trainer, str(conftest.T5X_TINY / layout))
  flat = traverse_util.flatten_dict(params, sep='/')
  expected = np.load(conftest.T5X_TINY / npz)
  assert set(expected.files) == {k for k in flat if 'hyperprompt' not in k}
  for k in expected.files:  # the backbone is the checkpoint's
    np.testing.assert_array_equal(np.asarray(flat[k]), expected[k], err_msg=k)
  assert fresh and all('hyperprompt' in k for k in fresh)
  init = traverse_util.flatten_dict(trainer.fresh_params(), sep='/')
  for k in fresh:  # new parameters freshly initialised
    np.testing.assert_array_equal(np.asarray(flat[k]), np.asarray(init[k]))
  state = trainer.new_state(params)
  assert int(state['step']) == 0


def test_training_from_a_t5x_checkpoint_starts_at_step_0(tmp_path):
  model = network.Transformer(_global_tiny_config())
  gin.clear_config()
  gin.bind_parameter('hyperprompt_jax.tasks.task_ids.run_task_list.benchmark',
                     'glue_super_glue')
  try:
    result = training_loop.train(model, settings=run_settings.RunSettings(
        model_dir=str(tmp_path), train_steps=2, batch_size=2,
        mixture_or_task_name='fixture_glue_super_glue_proportional',
        task_feature_lengths=LENGTHS, save_period=2, log_period=1,
        initial_checkpoint_path=str(conftest.T5X_TINY /
                                    'orbax/checkpoint_100'),
        optimizer=optimizers.make_optimizer()))
  finally:
    gin.clear_config()
  assert result['step'] == 2  # 2 fine-tuning steps from 0, not from 100
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == [
      'checkpoint_2']


def test_checkpoint_of_another_shape_fails_naming_the_parameter(tmp_path):
  model = network.Transformer(_global_tiny_config(mlp_dim=48, num_tasks=8))
  with pytest.raises(ValueError, match=r'mlp/wi_0/kernel: checkpoint'):
    training_loop.train(model, settings=_train_settings(
        tmp_path, initial_checkpoint_path=str(
            conftest.T5X_TINY / 'legacy/checkpoint_50')))
  assert not list((tmp_path / 'run').glob('checkpoint_*'))  # nothing written


# ----------------------------------------------------------------- sharding --

# The tiny HyperPrompt-Global T5 of the sharded step, with dropout.
SHARDED_DIMS = dict(vocab_size=384, emb_dim=32, num_heads=4, head_dim=8,
                    mlp_dim=64, num_encoder_layers=2, num_decoder_layers=2,
                    dropout_rate=0.1, num_tasks=8)
SHARDED_LENGTHS = {'inputs': 12, 'targets': 4}
SHARDED_BATCH = 8

# One SGD step of rate 1 from the same parameters on both meshes: the change
# of each parameter is its gradient (Adafactor's first step is a function of
# the gradient's sign for unfactored leaves, so a gradient within rounding of
# zero could flip an element; the gradient itself is continuous).
SHARDED = textwrap.dedent('''
    import json
    import jax, numpy as np, optax
    from flax import traverse_util
    from hyperprompt_jax.methods import hyperprompt
    from hyperprompt_jax.model import network
    from hyperprompt_jax.common import partitioning
    from hyperprompt_jax.training import trainer as trainer_lib
    assert jax.device_count() == 8
    cfg = network.T5Config(**{dims!r}, hyperprompt=hyperprompt.HyperPromptConfig(
        variant='global', encoder_prompt_length=4, decoder_prompt_length=2,
        hypernet_reduction=8, task_embed_dim=8, task_hidden_dim=16,
        layer_task_embed_dim=8))
    lengths, b = {lengths!r}, {batch}
    rng = np.random.default_rng(0)
    tgt = rng.integers(1, 384, (b, lengths['targets']), dtype=np.int32)
    batch = {{'encoder_input_tokens': rng.integers(
                  1, 384, (b, lengths['inputs']), dtype=np.int32),
             'decoder_target_tokens': tgt,
             'decoder_input_tokens': np.concatenate(
                 [np.zeros((b, 1), np.int32), tgt[:, :-1]], 1),
             'decoder_loss_weights': np.ones(tgt.shape, np.int32),
             'task_ids': rng.integers(0, 8, (b,), dtype=np.int32)}}
    auto = (jax.sharding.AxisType.Auto,) * 2
    meshes = {{
        'sharded': partitioning.create_mesh(data=2, model=4),
        'single': jax.make_mesh((1, 1), ('data', 'model'), axis_types=auto,
                                devices=jax.devices()[:1]),
    }}
    flat = lambda p: traverse_util.flatten_dict(jax.device_get(p), sep='/')
    out = {{}}
    for name, mesh in meshes.items():
      trainer = trainer_lib.Trainer(network.Transformer(cfg), optax.sgd(1.0),
                                    mesh, lengths)
      state = trainer.new_state(trainer.fresh_params())
      before = flat(state['params'])
      state, terms = trainer.step(state, trainer.global_batch(batch))
      after = flat(state['params'])
      out[name] = (float(terms['loss']),
                   {{k: before[k] - after[k] for k in before}})
      if name == 'sharded':  # really split over 'model', batch over 'data'
        kernel = state['params']['encoder']['layers_0']['mlp']['wi_0'][
            'kernel']
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(
            None, 'model'), kernel.sharding
        assert kernel.addressable_shards[0].data.shape == (32, 16)
    (loss, grads), (want_loss, want) = out['sharded'], out['single']
    errors = {{k: float(np.linalg.norm(grads[k] - want[k])
                       / max(np.linalg.norm(want[k]), 1e-30)) for k in want}}
    print('RESULT', json.dumps({{'loss': [loss, want_loss], 'errors': errors}}))
''')


def test_sharded_train_step_matches_a_single_device():
  """The step on 2 x 4 devices (batch over 'data', weights over 'model')
  gives the single device's loss and gradients to float32 rounding
  (`conftest.float32_bound` of the model's reductions)."""
  env = dict(_env(), XLA_FLAGS=multiprocess.xla_flags(8))
  script = SHARDED.format(dims=SHARDED_DIMS, lengths=SHARDED_LENGTHS,
                          batch=SHARDED_BATCH)
  result = subprocess.run([sys.executable, '-c', script], env=env,
                          capture_output=True, text=True, timeout=600)
  lines = [line for line in result.stdout.splitlines()
           if line.startswith('RESULT ')]
  assert lines, result.stderr[-3000:]
  report = json.loads(lines[0][len('RESULT '):])
  reductions = conftest.t5_reduction_lengths(
      network.T5Config(**SHARDED_DIMS), SHARDED_BATCH,
      SHARDED_LENGTHS['inputs'], SHARDED_LENGTHS['targets'], 4, 2)
  loss, want_loss = report['loss']
  # The loss is the forward half of the chain.
  assert abs(loss - want_loss) <= conftest.float32_bound(
      *reductions[:len(reductions) // 2]) * abs(want_loss)
  bound = conftest.float32_bound(*reductions)
  assert len(report['errors']) > 40
  worst = max(report['errors'], key=report['errors'].get)
  assert report['errors'][worst] <= bound, (worst, report['errors'][worst],
                                            bound)


# ---------------------------------------------------------------- bad input --

def _train_settings(tmp_path, **overrides):
  kwargs = dict(
      model_dir=str(tmp_path / 'run'), train_steps=4, batch_size=2,
      mixture_or_task_name='fixture_glue_proportional',
      task_feature_lengths=LENGTHS, save_period=2, log_period=1,
      optimizer=optimizers.make_optimizer())
  kwargs.update(overrides)
  return run_settings.RunSettings(**kwargs)


def _tiny_glue_model():
  return network.Transformer(_global_tiny_config(num_tasks=8))


def test_unknown_mixture_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="Unknown MIXTURE_OR_TASK_NAME 'glue_prop"):
    training_loop.train(_tiny_glue_model(), settings=_train_settings(
        tmp_path, mixture_or_task_name='glue_proportionall'))
  assert not list((tmp_path / 'run').glob('checkpoint_*'))


def test_unwritable_model_dir_is_a_clear_error(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('x')
  with pytest.raises(ValueError, match='MODEL_DIR .* is not writable'):
    training_loop.train(_tiny_glue_model(), settings=_train_settings(
        tmp_path, model_dir=str(blocker / 'run')))


def test_packed_hypergrid_run_trains_at_most_max_segments_a_row(
    tmp_path, monkeypatch):
  """The runner's packer closes rows at MAX_SEGMENTS (every batch it feeds
  holds at most that many examples a row) and the run record names it."""
  model = network.Transformer(network.T5Config(**{
      **vars(conftest.T5X_TINY_CONFIG), 'num_tasks': 8,
      'hypergrid': hypergrid.HyperGridConfig(grid_rows=4, grid_cols=8,
                                             max_segments=2)}))
  as_numpy, most = input_pipeline.as_numpy, []

  def counted(batch):
    batch = as_numpy(batch)
    most.append(int(batch['encoder_segment_ids'].max()))
    return batch

  monkeypatch.setattr(input_pipeline, 'as_numpy', counted)
  result = training_loop.train(model, settings=_train_settings(
      tmp_path, pack=True, train_steps=2, batch_size=2,
      task_feature_lengths={'inputs': 512, 'targets': 32}))
  assert result['step'] == 2 and np.isfinite(result['loss'])
  assert max(most) == 2  # fixture rows of 512 hold 3-5 examples unbounded
  record = run_record.read(str(tmp_path / 'run' / 'checkpoint_2'))
  assert record['data']['PACKER'] == packing.name(2)


def test_packed_prompt_tuning_run_trains(tmp_path, caplog):
  """The runner reserves the soft prompt's slots (validate_batch would
  refuse rows without them) and logs how full the rows are."""
  model = network.Transformer(network.T5Config(**{
      **vars(conftest.T5X_TINY_CONFIG), 'num_tasks': 8,
      'prompt_tuning': prompt_tuning.PromptTuningConfig(prompt_length=3)}))
  with caplog.at_level('INFO'):
    result = training_loop.train(model, settings=_train_settings(
        tmp_path, pack=True, train_steps=2, batch_size=2))
  assert result['step'] == 2 and np.isfinite(result['loss'])
  filled = [r.getMessage() for r in caplog.records
            if 'of rows filled' in r.getMessage()]
  assert filled, [r.getMessage() for r in caplog.records]


def test_num_tasks_smaller_than_the_task_list_is_refused(tmp_path):
  model = network.Transformer(_global_tiny_config(num_tasks=4))
  with pytest.raises(ValueError, match='NUM_TASKS=4'):
    training_loop.train(model, settings=_train_settings(tmp_path))


def test_out_of_range_task_id_stops_before_the_step(tmp_path, monkeypatch):
  """Inside jit the id would clamp (another task's parameters); the runner
  checks every batch on the host first."""
  as_numpy = input_pipeline.as_numpy

  def with_bad_id(batch):
    batch = dict(as_numpy(batch))
    batch['task_ids'] = np.full_like(batch['task_ids'], 8)
    return batch

  monkeypatch.setattr(input_pipeline, 'as_numpy', with_bad_id)
  with pytest.raises(ValueError, match=r'task_ids has ids \[8\] outside '
                     r'\[0, num_tasks=8\)'):
    training_loop.train(_tiny_glue_model(), settings=_train_settings(tmp_path))
  assert not list((tmp_path / 'run').glob('checkpoint_*'))


def _nan_from(step: int) -> optax.GradientTransformation:
  """Updates become NaN from optimizer step `step` on (0-based)."""
  def init(params):
    del params
    return {'count': jax.numpy.zeros((), jax.numpy.int32)}

  def update(updates, state, params=None):
    del params
    bad = state['count'] >= step
    updates = jax.tree.map(
        lambda u: jax.numpy.where(bad, jax.numpy.nan, u), updates)
    return updates, {'count': state['count'] + 1}

  return optax.GradientTransformation(init, update)


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  optimizer = optax.chain(optimizers.make_optimizer(), _nan_from(5))
  with pytest.raises(training_loop.NonFiniteLossError,
                     match='Last good checkpoint: checkpoint_4'):
    training_loop.train(_tiny_glue_model(), settings=_train_settings(
        tmp_path, train_steps=10, optimizer=optimizer))
  run = tmp_path / 'run'
  assert sorted(p.name for p in run.glob('checkpoint_*')) == [
      'checkpoint_2', 'checkpoint_4']
  for k, v in _saved_params(run, 4).items():
    assert np.isfinite(v).all(), k


# ---------------------------------------------------------------- run files --

@pytest.mark.parametrize('run,num_tasks,placement,steps', [
    ('quickstart', 16, 'both', 1300),
    ('hyperprompt_glue', 8, 'both', 300_000),
    ('hyperprompt_super_glue', 8, 'decoder', 300_000),
    ('hypergrid_glue_super_glue', 16, None, 100_000)])
def test_run_gin_files(run, num_tasks, placement, steps):
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.tasks import task_ids  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    gin_utils.parse_gin([f'runs/{run}.gin'], ["MODEL_DIR='/tmp/x'"], [])
    config = gin.get_configurable(network.Transformer)().config
    assert config.num_tasks == num_tasks == len(task_ids.run_task_list())
    if placement:
      assert config.hyperprompt.placement == placement
      assert config.hyperprompt.variant == 'global'
    else:
      assert config.hypergrid.variant == 'lg'
      assert gin.query_parameter('%FREEZE_EMBEDDINGS') is True
    assert gin.query_parameter('%TRAIN_STEPS') == steps
    if run != 'quickstart':
      assert gin.query_parameter('%BATCH_SIZE') == 128
      assert gin.query_parameter('%SAVE_PERIOD') == 2000
      assert gin.query_parameter('%INITIAL_CHECKPOINT_PATH').startswith(
          'gs://t5-data/pretrained_models/t5x/')
      assert gin.query_parameter('%TASK_FEATURE_LENGTHS') == {
          'inputs': 512, 'targets': 32}
  finally:
    gin.clear_config()
