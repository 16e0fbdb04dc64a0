"""The MFU benchmark (`benchmarks/mfu.py`, `tools/device_benchmark.sh`): its
gin-free configs are the gin files', its synthetic rows are valid model
batches, its peak table reads device kinds, and the device script's path
runs on a CPU without TensorFlow, seqio, orbax or gin."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import types

import gin
import numpy as np
import pytest

from hyperprompt_jax import paths
from hyperprompt_jax.benchmarks import benchmark_suite
from hyperprompt_jax.benchmarks import length_estimates
from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.common import batches
from hyperprompt_jax.common import gin_literals
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import glue
from hyperprompt_jax.tasks import super_glue

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize('backbone', sorted(mfu.BACKBONES))
def test_backbones_are_the_gin_models(backbone):
  gin.clear_config()
  gin.parse_config_file(
      os.path.join(paths.gin_dir(), 'models', f'{backbone}.gin'))
  from_gin = gin.get_configurable(network.Transformer)().config
  gin.clear_config()
  ours = mfu.model_config(backbone, 'mtl', dtype=from_gin.dtype)
  assert dataclasses.replace(ours, check_traced_task_ids=True) == from_gin


@pytest.mark.parametrize('variant', [v for v in mfu.VARIANTS if v != 'mtl'])
def test_variants_are_the_gin_variants(variant):
  base = mfu.model_config('t5_1_1_base', 'mtl')
  assert mfu.model_config('t5_1_1_base', variant) == dataclasses.replace(
      benchmark_suite.variant_config(base, variant, 'both'))


def test_length_estimates_weigh_tasks_by_their_training_examples():
  rates = {s.name: s.rate for s in (*glue.GLUE, *super_glue.SUPER_GLUE)}
  assert {name: examples for name, (examples, _, _) in
          length_estimates.GLUE_SUPER_GLUE.items()} == {
              name: rates[name] for name in length_estimates.GLUE_SUPER_GLUE}


def test_gin_literals_refuses_what_needs_gin(tmp_path, monkeypatch):
  (tmp_path / 'models').mkdir()
  (tmp_path / 'models' / 'x.gin').write_text(
      "include 'models/y.gin'\nN = %M\nnetwork.T5Config.emb_dim = %N\n")
  (tmp_path / 'models' / 'y.gin').write_text(
      'M = 4\nnetwork.T5Config:\n  mlp_dim = [1,\n    2]\n')
  monkeypatch.setattr(paths, 'gin_dir', lambda: str(tmp_path))
  with pytest.raises(ValueError, match=r"y.gin:4: '2\]' is not a one-line"):
    gin_literals.read('models/x.gin')
  (tmp_path / 'models' / 'y.gin').write_text('M = 4\n')
  assert gin_literals.read('models/x.gin') == {
      'network.T5Config': {'emb_dim': 4}}


@pytest.mark.parametrize('slots', [0, 12])
def test_packed_rows_are_valid_batches(slots):
  batch, stats = mfu.synthetic_rows(8, 512, 32, 32128, 8, packed=True,
                                    prompt_slots=slots)
  batches.validate_batch(batch, 8, 32128, batches.RowFormat(
      packed=True, input_prompt_length=slots))
  assert stats['examples'] > 8 and stats['fill'] > 0.8
  for side in ('encoder', 'decoder'):
    seg = batch[f'{side}_segment_ids']
    pos = batch[f'{side}_positions']
    # Positions count from 0 within each example, and padding is segment 0.
    starts = (seg > 0) & (np.diff(seg, prepend=0) != 0)
    assert (pos[starts] == 0).all()
    assert (batch[f'{side}_task_ids'][seg == 0] == 0).all()
  assert ((batch['encoder_input_tokens'] > 0)
          == (batch['encoder_segment_ids'] > 0)).all()
  targets = batch['decoder_target_tokens']
  inputs = batch['decoder_input_tokens']
  seg = batch['decoder_segment_ids']
  # Teacher forcing within each example: 0 first, then its targets shifted.
  inside = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  assert (inputs[:, 1:][inside] == targets[:, :-1][inside]).all()
  assert (inputs[batch['decoder_positions'] == 0] == 0).all()
  real = (batch['encoder_input_tokens'] > 0).sum() + (targets > 0).sum()
  assert stats['real_tokens'] == real - slots * stats['examples']


def test_packed_rows_honour_a_bound_on_examples():
  batch, stats = mfu.synthetic_rows(8, 512, 32, 32128, 16, packed=True,
                                    max_segments=3)
  assert batch['encoder_segment_ids'].max() == 3
  assert stats['examples'] <= 24
  # HyperGrid-LG's bound (MAX_SEGMENTS) is the one its rows are packed to.
  cfg = mfu.model_config('t5_1_1_base', 'hypergrid_lg')
  assert cfg.hypergrid.max_segments == 8


def test_unpacked_rows_hold_one_example_each():
  batch, stats = mfu.synthetic_rows(8, 512, 32, 32128, 16, packed=False)
  batches.validate_batch(batch, 16, 32128)
  assert stats['examples'] == 8
  assert stats['real_tokens'] == ((batch['encoder_input_tokens'] > 0).sum()
                                  + (batch['decoder_target_tokens'] > 0).sum())


@pytest.mark.parametrize('kind, tflops', [
    ('NVIDIA H100 80GB HBM3', 989), ('NVIDIA H200', 989),
    ('NVIDIA H100 PCIe', 756), ('NVIDIA A100-SXM4-80GB', 312),
    ('TPU v4', 275), ('TPU v5 lite', 197), ('TPU v5e', 197), ('TPU v5', 459),
    ('TPU v5p', 459), ('TPU v6 lite', 918), ('TPU v6e', 918), ('cpu', None)])
def test_peak_tflops_by_device_kind(kind, tflops):
  device = types.SimpleNamespace(device_kind=kind)
  assert mfu.peak_tflops(device) == tflops
  assert mfu.peak_tflops(device, 100.0) == 100.0


# A module set to None in sys.modules is what Python reports as not
# installed: `import` raises ModuleNotFoundError and importlib.util.find_spec
# returns None (etils.epath probes for TensorFlow that way).
_BLOCKER = '''
import sys

for name in {blocked!r}:
  sys.modules[name] = None
'''


def test_device_script_runs_on_a_cpu_without_tensorflow_or_gin(tmp_path):
  """tools/device_benchmark.sh at the tiny model (one layer a stack), one
  variant, as on a bare accelerator image (TensorFlow, seqio, tfds, orbax
  and gin unimportable)."""
  site = tmp_path / 'site'
  site.mkdir()
  (site / 'sitecustomize.py').write_text(_BLOCKER.format(blocked=(
      'tensorflow', 'seqio', 'tensorflow_datasets', 'orbax', 'gin', 'clu')))
  out = tmp_path / 'out'
  env = {**os.environ, 'OUT': str(out), 'JAX_PLATFORMS': 'cpu',
         'PYTHONPATH': str(site),
         'PATH': f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}'}
  result = subprocess.run(
      ['bash', str(ROOT / 'tools' / 'device_benchmark.sh'),
       '--model=t5_1_1_tiny', '--num_layers=1', '--dtype=float32',
       '--batch_size=2', '--input_length=32', '--target_length=8',
       '--variants=adapter', '--warmup_steps=0', '--steps=1',
       '--peak_tflops=1'],
      capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  report = json.loads((out / 'mfu.json').read_text())
  assert report['num_layers'] == 1
  assert [(r['variant'], r['form'], r['rows'])
          for r in report['rows']] == [
              ('mtl', 'auto', 'packed'), ('adapter', 'written', 'packed'),
              ('adapter', 'autodiff', 'packed')]
  assert [r['label'] for r in report['rows']] == [
      'mtl', 'adapter [written]', 'adapter [autodiff]']
  for row in report['rows']:
    assert row['xla_flops'] > 0 and row['six_nd_flops'] > 0
    assert row['mfu'] == pytest.approx(
        row['xla_flops'] / row['seconds_per_step'] / 1e12)
  assert report['rows'][0]['ratio_to_mtl'] == 1.0
  assert 'MFU' in (out / 'mfu.log').read_text()
  # The script traces MTL's step; a CPU trace has no device plane to sum,
  # and the compiled module's text lies beside it.
  assert report['rows'][0]['kernel_times'] is None
  assert 'ENTRY' in (out / 'profiles' / 'mtl_auto' / 'step.hlo.txt'
                     ).read_text()


def test_forms_pick_the_runs():
  everything = list(mfu.VARIANTS)
  assert mfu.runs(['hypergrid_lg', 'adapter'], 'both') == [
      ('mtl', 'auto'), ('hypergrid_lg', 'blockwise'),
      ('hypergrid_lg', 'grouped'), ('adapter', 'written'),
      ('adapter', 'autodiff')]
  assert mfu.runs(everything, 'written,grouped') == [
      ('mtl', 'auto'), ('hyperprompt_global', 'written'),
      ('hypergrid_lg', 'grouped'),
      ('adapter', 'written'), ('hyperformer_pp', 'written'),
      ('prompt_tuning', 'auto')]
  assert {form for _, form in mfu.runs(everything, 'auto')} == {'auto'}
  # The TPU kernel only where named ('both': the CPU's and the plain form).
  assert mfu.runs(['hypergrid_lg'], 'pallas,blockwise') == [
      ('mtl', 'auto'), ('hypergrid_lg', 'blockwise'),
      ('hypergrid_lg', 'pallas')]


def test_an_old_form_name_still_works_with_a_warning(capsys):
  """HyperGrid's 'token_blocks' is 'blockwise': --forms takes the
  old name for one release, warning with the new."""
  with pytest.warns(DeprecationWarning,
                    match="'token_blocks' is now 'blockwise'"):
    assert mfu.form_names('pallas,token_blocks') == 'pallas,blockwise'
  assert "'token_blocks' is now 'blockwise'" in capsys.readouterr().err
  assert mfu.form_names('both') == 'both'
