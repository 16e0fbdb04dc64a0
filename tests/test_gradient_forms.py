"""`T5Config.gradient_form`: the gradients written for XLA:CPU ('written')
and JAX's own ('autodiff', the accelerators' form) give the same loss and
gradients, packed and unpacked, for every model that has both (the
adapters, HyperFormer++, packed HyperPrompt); 'auto' picks per backend."""

import dataclasses
import functools

from flax import traverse_util
import jax
import numpy as np
import pytest

import conftest
from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import task_blocks
from hyperprompt_jax.training import trainer


def _model(name, form):
  """The paper's `name` on t5_1_1_tiny, one encoder and one decoder layer
  (each layer takes the form alike; one of each stack shows it)."""
  return network.Transformer(dataclasses.replace(
      mfu.model_config('t5_1_1_tiny', name, 'float32', form), dropout_rate=0.0,
      num_encoder_layers=1, num_decoder_layers=1))


@functools.cache
def _params(name):
  """`name`'s parameters, one compiled initialisation for both forms (the
  form changes no parameter) and both row formats (numpy)."""
  model = _model(name, 'written')
  return jax.device_get(jax.jit(lambda rng: network.init_variables(
      model, rng, 64, 8)['params'])(jax.random.PRNGKey(0)))


def _loss_and_grads(name, form, batch):
  model = _model(name, form)
  fn = jax.jit(jax.value_and_grad(
      functools.partial(trainer.loss_fn, model, z_loss=1e-4), has_aux=True))
  (loss, _), grads = fn(_params(name), batch, jax.random.PRNGKey(1))
  return float(loss), traverse_util.flatten_dict(grads, sep='/')


@pytest.mark.parametrize('packed', [True, False], ids=['packed', 'unpacked'])
@pytest.mark.parametrize('name', mfu.TWO_FORMS)
def test_autodiff_form_equals_the_written_one(name, packed):
  batch, _ = mfu.synthetic_rows(4, 64, 8, 384, 8, packed=packed)
  loss, grads = _loss_and_grads(name, 'written', batch)
  loss_ad, grads_ad = _loss_and_grads(name, 'autodiff', batch)
  # Two orders of the model's sums: the loss its forward half, each
  # gradient all of them, relative to the tensor's largest entry.
  reductions = conftest.model_reduction_lengths(
      _model(name, 'written').config, 4, 64, 8)
  conftest.assert_close_to_scale(loss_ad, loss, conftest.float32_bound(
      *reductions[:len(reductions) // 2], 4 * 8))
  assert grads_ad.keys() == grads.keys()
  bound = conftest.float32_bound(*reductions)
  for path, g in grads.items():
    conftest.assert_close_to_scale(grads_ad[path], g, bound, name=path)


def test_auto_is_written_on_cpu_and_bad_forms_are_refused():
  assert jax.default_backend() == 'cpu'
  assert task_blocks.resolve_gradient_form('auto') == 'written'
  assert task_blocks.resolve_gradient_form('autodiff') == 'autodiff'
  cfg = dataclasses.replace(mfu.model_config('t5_1_1_tiny', 'adapter'),
                            gradient_form='scatter')
  with pytest.raises(ValueError, match='gradient_form'):
    network.check_config(cfg)



# XLA:CPU compile options without its YNNPACK fusions, which (jaxlib 0.10.2)
# miscompile some batched backward passes whatever the model
# (`test_metabalance.test_xla_cpu_reduces_a_broadcast_operand_rightly`).
WITHOUT_YNN_FUSIONS = {'xla_cpu_experimental_ynn_fusion_type': ''}


@pytest.mark.parametrize('name', mfu.TWO_FORMS)
def test_vmap_of_the_written_vjp_is_a_loop_of_it(name):
  """The written gradients batch as they compute: `jax.vmap` of the
  model's VJP (packed rows, 'written' form) over 3 cotangents of the
  logits equals a loop of the same VJP (`lax.map`), in one program compiled
  `WITHOUT_YNN_FUSIONS`."""
  batch, _ = mfu.synthetic_rows(2, 32, 8, 384, 8, packed=True)
  model = _model(name, 'written')
  cotangents = np.random.default_rng(0).normal(
      size=(3, 2, 8, 384)).astype(np.float32)

  def both(params, cotangents):
    _, vjp_fn = jax.vjp(lambda p: trainer._logits(
        model, p, batch, jax.random.PRNGKey(1), None), params)
    return jax.vmap(vjp_fn)(cotangents)[0], jax.lax.map(vjp_fn,
                                                         cotangents)[0]

  params = _params(name)
  batched, looped = jax.jit(both).lower(params, cotangents).compile(
      WITHOUT_YNN_FUSIONS)(params, cotangents)
  batched = traverse_util.flatten_dict(batched, sep='/')
  reductions = conftest.model_reduction_lengths(model.config, 2, 32, 8)
  bound = conftest.float32_bound(*reductions[len(reductions) // 2:])
  for path, gs in traverse_util.flatten_dict(looped, sep='/').items():
    for i, g in enumerate(gs):
      # The same backward pass, its contractions batched: only the order
      # of their sums may differ (the backward half of the model's
      # reductions, then the sum over the rows' tokens).
      conftest.assert_close_to_scale(batched[path][i], g, bound, name=path)
