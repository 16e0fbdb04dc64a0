"""MetaBalance (`metabalance.balance`) against a numpy re-derivation of the
dissertation's Algorithm 2 (ch. 4, the complete version), written from the
algorithm's lines, not from the module."""

import dataclasses
import functools
import shutil

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
from hyperprompt_jax import task_params
from hyperprompt_jax.checkpointing import checkpoint_manager
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import batches
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.t5 import losses
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import trainer as trainer_lib

R, BETA, K = 0.7, 0.9, 3
U = conftest.FLOAT32_UNIT_ROUNDOFF


def numpy_algorithm_2(steps, strategy, r=R, beta=BETA, averages=None):
  """`steps`: a list of (G_tar {leaf: array}, [G_aux,i {leaf: array}],
  present [K + 1]). Returns the G_total of each step; `averages`, a list,
  gets each step's moving averages `({leaf: m_tar}, {leaf: [K] m_i})`
  appended."""
  m_tar, m_aux, totals = {}, {}, []
  for g_tar, g_aux, present in steps:
    total = {}
    for leaf in g_tar:
      m_t = m_tar.get(leaf, 0.0)  # line 1: m^0 = 0
      if present[0]:  # line 4, only when the target is in the batch
        m_t = beta * m_t + (1 - beta) * np.linalg.norm(g_tar[leaf])
      m_tar[leaf] = m_t
      out = g_tar[leaf] * present[0]
      for i in range(len(g_aux)):
        m_i = m_aux.get((leaf, i), 0.0)
        if not present[i + 1]:  # absent: nothing, m_i kept
          continue
        g = g_aux[i][leaf]
        m_i = beta * m_i + (1 - beta) * np.linalg.norm(g)  # line 7
        m_aux[(leaf, i)] = m_i
        holds = {'shrink': m_i > m_t, 'enlarge': m_i < m_t,
                 'both': m_i > m_t or m_i < m_t}[strategy]
        if holds and m_i > 0:  # line 9 (m_i = 0: not rescaled)
          g = g * m_t / m_i * r + g * (1 - r)
        out = out + g  # line 12
      total[leaf] = out
    totals.append(total)
    if averages is not None:
      averages.append(({k: m_tar[k] for k in g_tar},
                       {k: np.array([m_aux.get((k, i), 0.0)
                                     for i in range(len(g_aux))])
                        for k in g_tar}))
  return totals


def _steps(seed=0, num_steps=5):
  rng = np.random.default_rng(seed)
  shapes = {'a': (3, 4), 'b': (5,), 'c': (2, 2, 2)}
  steps = []
  for t in range(num_steps):
    # Magnitudes that differ by task (auxiliary 1 larger, 2 smaller).
    g_tar = {k: rng.normal(size=s) for k, s in shapes.items()}
    g_aux = [{k: rng.normal(size=s) * [1.0, 5.0, 0.2][i]
              for k, s in shapes.items()} for i in range(K)]
    present = np.ones(K + 1, bool)
    if t == 2:  # auxiliary 2 absent: its gradient is 0 (no tokens)
      present[3] = False
      g_aux[2] = {k: np.zeros(s) for k, s in shapes.items()}
    if t == 3:  # the target absent
      present[0] = False
      g_tar = {k: np.zeros(s) for k, s in shapes.items()}
    steps.append((g_tar, g_aux, present))
  return steps


def _magnitudes(steps, strategy):
  """Algorithm 2 run on |G| (the same norms, so the same scales): each
  total's Σ_i s_i |G_i|, what its rounding is relative to."""
  return numpy_algorithm_2(
      [({k: np.abs(v) for k, v in t.items()},
        [{k: np.abs(v) for k, v in g.items()} for g in a], p)
       for t, a, p in steps], strategy)


def _tolerances(steps):
  """(total, average) relative bounds in units of u: the derivation of
  `test_running_sums_match_algorithm_2`."""
  n = max(v.size for v in steps[0][0].values())
  average_tol = (n / 2 + 5 + 3 * len(steps)) * U
  return (2 * average_tol / U + 3 + K + 2) * U, average_tol


@pytest.mark.parametrize('strategy', metabalance.STRATEGIES)
def test_balance_matches_algorithm_2(strategy):
  steps = _steps()
  expected = numpy_algorithm_2(steps, strategy)
  magnitudes = _magnitudes(steps, strategy)
  # As `test_running_sums_match_algorithm_2`, and each G rounded to float32.
  total_tol = _tolerances(steps)[0] + U
  state = metabalance.init(steps[0][0], K)
  for (g_tar, g_aux, present), want, size in zip(steps, expected,
                                                 magnitudes):
    total, state = metabalance.balance(
        {k: np.float32(v) for k, v in g_tar.items()},
        [{k: np.float32(v) for k, v in g.items()} for g in g_aux], state,
        relax_factor=R, beta=BETA, strategy=strategy, present=present)
    for leaf in want:
      conftest.assert_close_to_scale(total[leaf], want[leaf], total_tol,
                                     size[leaf], leaf)


def test_a_zero_moving_average_is_not_rescaled():
  """An auxiliary absent since the start (m = 0) then present with a zero
  gradient: no division by zero, no NaN."""
  g = {'w': np.ones((2,), np.float32)}
  zero = {'w': np.zeros((2,), np.float32)}
  state = metabalance.init(g, 2)
  total, state = metabalance.balance(
      g, [zero, g], state, relax_factor=1.0, beta=0.0, strategy='both',
      present=np.array([True, True, False]))
  np.testing.assert_array_equal(total['w'], [1.0, 1.0])  # m_1 = 0: as is
  assert float(state.auxiliary['w'][1]) == 0.0  # absent: kept
  assert np.isfinite(state.auxiliary['w']).all()


def test_relax_factor_by_hand():
  """β = 0 makes m the current norm: ‖G_tar‖ = 3, ‖G_aux‖ = 4 (3-4-5), so
  with r = 1 the auxiliary is scaled to norm 3, with r = 0.5 by
  0.5·3/4 + 0.5 = 7/8; 'enlarge' leaves it (4 > 3)."""
  g_tar = {'w': np.array([3.0, 0.0], np.float32)}
  g_aux = {'w': np.array([0.0, 4.0], np.float32)}
  state = metabalance.init(g_tar, 1)
  for r, strategy, want in [(1.0, 'both', [3.0, 3.0]),
                            (0.5, 'shrink', [3.0, 3.5]),
                            (1.0, 'enlarge', [3.0, 4.0]),
                            (0.0, 'both', [3.0, 4.0])]:
    total, _ = metabalance.balance(g_tar, [g_aux], state, relax_factor=r,
                                   beta=0.0, strategy=strategy)
    # `_tolerances` of one step of 2-entry tensors, K = 1.
    conftest.assert_close_to_scale(total['w'], want,
                                   (2 * (1 + 5 + 3) + 3 + 1 + 2) * U,
                                   np.abs(want))




def _linear_step(plan):
  """`(params, state, [G_tar, G_aux,1, ...], present) -> balanced_gradient`
  of shares linear in the parameters, `Σ_leaf Σ G_share * θ`: each share's
  gradient is exactly its float32 G (the cotangents are one-hot: products
  by 1 and sums with 0). One program for every step."""

  def step(params, state, grads, present):
    def shares_fn(p):
      return jnp.stack([sum(jnp.sum(g[k] * p[k]) for k in g)
                        for g in grads]), {'aux': 0}
    return metabalance.balanced_gradient(shares_fn, params, state, plan,
                                         present)
  return jax.jit(step)


@pytest.mark.parametrize('strategy', metabalance.STRATEGIES)
def test_running_sums_match_algorithm_2(strategy):
  """`balanced_gradient` (the shares' gradients taken and added one after
  the other) against Algorithm 2 in numpy (float64) over every share's
  gradient at once, over 5 steps with an absent auxiliary and an absent
  target: the totals, the task-row parameter's plain sum and the moving
  averages.

  The gradients are exact (`_linear_shares`), so what differs is float32's
  rounding of the norms, averages, scales and sums. With u = 2^-24, n the
  largest tensor's size and T steps: a norm is within (n / 2 + 2) u, an
  average within another 3 u a step, so (n / 2 + 5 + 3 T) u; a scale
  (r m_tar / m_i + 1 - r) within twice that + 3 u; the total of K + 1
  scaled terms within (that + K + 2) u of Σ_i s_i |G_i|, which is Algorithm
  2 run on |G| (the same norms, so the same scales)."""
  raw = _steps()
  steps = [({**{k: np.float32(v) for k, v in g_tar.items()},
             'rows': np.float32(g_tar['a'][:2])},
            [{**{k: np.float32(v) for k, v in g.items()},
              'rows': np.float32(g['a'][:2])} for g in g_aux], present)
           for g_tar, g_aux, present in raw]
  shared = [k for k in steps[0][0] if k != 'rows']
  only = lambda tree: {k: tree[k] for k in shared}
  numpy_steps = [(only(t), [only(g) for g in a], p) for t, a, p in steps]
  averages = []
  want = numpy_algorithm_2(numpy_steps, strategy, averages=averages)
  bound = _magnitudes(numpy_steps, strategy)
  total_tol, average_tol = _tolerances(steps)

  names = ('t', 'a1', 'a2', 'a3')  # 'rows': a parameter with a task axis
  plan = metabalance.make_plan(
      metabalance.Settings(target_task='t', relax_factor=R, beta=BETA,
                           strategy=strategy), names, names, {'rows'})
  step = _linear_step(plan)
  params = {k: np.ones_like(v) for k, v in steps[0][0].items()}
  state = metabalance.init(only(params), K)
  for i, (g_tar, g_aux, present) in enumerate(steps):
    total, state, aux = step(params, state, [g_tar, *g_aux], present)
    assert aux == {'aux': 0}
    for k in shared:
      np.testing.assert_array_less(
          np.abs(total[k] - want[i][k]), total_tol * bound[i][k] + 1e-30,
          err_msg=k)
      m_tar, m_aux = averages[i]
      np.testing.assert_allclose(state.target[k], m_tar[k],
                                 rtol=average_tol, err_msg=k)
      np.testing.assert_allclose(state.auxiliary[k], m_aux[k],
                                 rtol=average_tol, err_msg=k)
    rows = [g_tar['rows']] + [g['rows'] for g in g_aux]
    np.testing.assert_array_less(
        np.abs(total['rows'] - np.sum(rows, axis=0, dtype=np.float64)),
        (K + 1) * U * np.sum(np.abs(rows), axis=0) + 1e-30)


def test_the_step_holds_three_gradients_whatever_k():
  """XLA's memory analysis of `balanced_gradient` on a one-matrix model
  (`[512, 512]` float32, a 1 MiB gradient; 64 tokens, each in one share):
  its temporaries at K = 16 auxiliaries are those at K = 2 (what grows with
  K, the moving averages and the shares' masks, is 17 floats + 64 x 17
  floats here), and at most three gradients besides the activations."""
  d, tokens = 512, 64
  x = np.random.default_rng(0).normal(size=(d, tokens)).astype(np.float32)
  gradient_bytes = d * d * 4

  def temp_bytes(num_aux):
    names = [f't{i}' for i in range(num_aux + 1)]
    plan = metabalance.make_plan(metabalance.Settings(target_task='t0'),
                                 names, names, ())
    masks = jax.nn.one_hot(np.arange(tokens) % (num_aux + 1), num_aux + 1)

    def shares_fn(p):
      h = jnp.tanh(p['w'] @ x)  # [d, tokens]
      return jnp.square(h).sum(0) @ masks, None

    params = {'w': jax.ShapeDtypeStruct((d, d), jnp.float32)}
    state = jax.eval_shape(lambda p: metabalance.init(p, num_aux), params)
    compiled = jax.jit(lambda p, s: metabalance.balanced_gradient(
        shares_fn, p, s, plan, jnp.ones(num_aux + 1, bool))[:2]).lower(
            params, state).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  activations = 2 * d * tokens * 4  # h and its cotangent
  few, many = temp_bytes(2), temp_bytes(16)
  assert many <= few + 17 * (tokens + 1) * 4 * 2, (few, many)
  assert many <= 3 * gradient_bytes + activations, (
      many / gradient_bytes)


def test_xla_cpu_reduces_a_broadcast_operand_rightly():
  """Why `balanced_gradient` takes no `vmap` over the shares' backward
  passes (besides its memory): XLA:CPU's YNNPACK fusions (jaxlib 0.10.2)
  compute `(a * b).sum(-1, keepdims=True) + b`, `a [512, 32]` broadcast
  against `b [4, 512, 32]`, wrongly, the shape of a batched backward pass
  (an unbatched residual times batched cotangents; the model's encoder
  under `jax.vmap` of its VJP over 8 cotangents, any model, packed or not).
  Right without those fusions; xfails while the default compiler gets it
  wrong, passes once a jaxlib computes it rightly."""
  rng = np.random.default_rng(0)
  a = rng.normal(size=(512, 32)).astype(np.float32)
  b = rng.normal(size=(4, 512, 32)).astype(np.float32)
  want = (a.astype(np.float64) * b).sum(-1, keepdims=True) + b
  lowered = jax.jit(lambda a, b: (a * b).sum(-1, keepdims=True) + b).lower(
      a, b)
  # A float32 sum of 32 products: within 32 u of Σ|a b| (+ 1 u of b).
  bound = 33 * U * ((np.abs(a) * np.abs(b)).sum(-1, keepdims=True)
                    + np.abs(b))
  right = lambda out: bool((np.abs(np.asarray(out) - want) <= bound).all())
  assert right(lowered.compile({'xla_cpu_experimental_ynn_fusion_type': ''})(
      a, b))
  if not right(lowered.compile()(a, b)):
    pytest.xfail('XLA:CPU (YNNPACK fusions) computes it wrongly: keep the '
                 "shares' backward passes in lax.scan")


@pytest.mark.parametrize('field, value, message', [
    ('target_task', None, 'needs METABALANCE_TARGET_TASK'),
    ('relax_factor', 1.5, r'METABALANCE_RELAX=1.5: r must be in \[0, 1\]'),
    ('beta', 1.0, r'METABALANCE_BETA=1.0: β must be in \[0, 1\)'),
    ('strategy', 'C', "METABALANCE_STRATEGY='C'"),
    ('auxiliaries', 'some', "METABALANCE_AUXILIARIES='some'"),
])
def test_settings_out_of_range_are_named(field, value, message):
  settings = metabalance.Settings(target_task='glue_rte')
  settings.check()
  with pytest.raises(ValueError, match=message):
    metabalance.Settings(**{**vars(settings), field: value}).check()


# ------------------------------------------------ the step (trainer.py) --

TASKS = ('glue_cola', 'glue_sst2', 'glue_mrpc', 'glue_stsb', 'glue_qqp',
         'glue_mnli', 'glue_qnli', 'glue_rte')
# Target glue_rte (id 7); auxiliaries cola, sst2, mrpc (ids 0, 1, 2);
# mrpc absent from the batch.
ROW_TASKS = np.array([7, 0, 1, 7, 0, 1], np.int32)


def _model():
  """HyperPrompt-Global (task-conditioned and shared parameters) on one
  encoder and one decoder layer: how MetaBalance treats a parameter does
  not depend on the depth."""
  cfg = dict(vars(conftest.T5X_TINY_CONFIG))
  cfg.update(num_tasks=8, num_encoder_layers=1, num_decoder_layers=1,
             hyperprompt=conftest.TINY_GLOBAL_PROMPTS)
  return network.Transformer(network.T5Config(**cfg))


@pytest.fixture(scope='module')
def global_model_and_batch():
  model = _model()
  rng = np.random.default_rng(0)
  targets = conftest.random_tokens(rng, (6, 5), pad_from=[5, 3, 4, 2, 5, 4])
  batch = {
      'encoder_input_tokens': conftest.random_tokens(
          rng, (6, 9), pad_from=[9, 7, 5, 9, 6, 8]),
      'decoder_input_tokens': conftest.decoder_inputs(targets),
      'decoder_target_tokens': targets,
      'decoder_loss_weights': (targets > 0).astype(np.float32),
      'task_ids': ROW_TASKS}
  params = jax.jit(lambda: model.init(
      jax.random.PRNGKey(1), batch['encoder_input_tokens'],
      batch['decoder_input_tokens'], targets, task_ids=ROW_TASKS,
      enable_dropout=False)['params'])()
  return model, params, batch


def _plan(model, trained=('glue_rte', 'glue_cola', 'glue_sst2', 'glue_mrpc'),
          **settings):
  return metabalance.make_plan(
      metabalance.Settings(target_task='glue_rte', **settings), TASKS,
      trained, task_params.task_axes(model))


def _bound(model, batch, inputs, targets):
  """The relative difference two orders of the model's sums may make in a
  gradient (`conftest.float32_bound` of its reductions, the prompts more
  keys)."""
  prompts = model.config.hyperprompt
  return conftest.float32_bound(*conftest.t5_reduction_lengths(
      model.config, batch, inputs, targets, prompts.encoder_prompt_length,
      prompts.decoder_prompt_length))


def _assert_update_close(got, want, start, g, name):
  """Parameters after Adafactor steps of gradients within g of each other:
  the update within 3g (the gradient, the root of its second moments, the
  RMS of the clipping), the parameters within that and one rounding of
  the sum."""
  update = np.linalg.norm(want - start)
  conftest.assert_close_in_norm(got - start, want - start, 3 * g, name)
  conftest.assert_close_in_norm(
      got, want, 3 * g * update / max(np.linalg.norm(want), 1e-30)
      + conftest.float32_bound(1), name)


def _task_grads(model, params, batch, rows):
  """∇ of the loss share of the rows of `rows` (their tokens' cross-entropy
  + z-loss over ALL real target tokens): one masked loss at a time."""
  weights = batch['decoder_loss_weights']
  mask = np.isin(ROW_TASKS, rows)[:, None] * weights
  return conftest.flat(_share_grad(model, params, batch, mask))


@functools.partial(jax.jit, static_argnums=0)
def _share_grad(model, params, batch, mask):
  """∇ of the loss share of the target tokens `mask` selects (one program
  for every mask)."""
  weights = batch['decoder_loss_weights']

  def share(p):
    logits = model.apply({'params': p}, batch['encoder_input_tokens'],
                         batch['decoder_input_tokens'],
                         batch['decoder_target_tokens'],
                         task_ids=batch['task_ids'], enable_dropout=False)
    terms = losses.cross_entropy_with_z_loss(
        logits, batch['decoder_target_tokens'], mask, 1e-4)
    return terms['loss'] * mask.sum() / weights.sum()
  return jax.grad(share)(params)


@pytest.mark.parametrize('auxiliaries', metabalance.AUXILIARIES)
def test_the_step_balances_shared_parameters_only(global_model_and_batch,
                                                  auxiliaries):
  """Two steps of `trainer.balanced_grads` against per-task gradients
  taken one masked loss at a time and Algorithm 2 in numpy; parameters
  with a task axis take the plain sum."""
  model, params, batch = global_model_and_batch
  plan = _plan(model, auxiliaries=auxiliaries)
  rows = task_params.task_axes(model)
  assert rows and all(k in rows for k in plan.task_rows)
  g_tar = _task_grads(model, params, batch, [7])
  aux_rows = [[0], [1], [2]] if auxiliaries == 'each' else [[0, 1, 2]]
  g_aux = [_task_grads(model, params, batch, r) for r in aux_rows]
  present = np.array([True] + [any(t in ROW_TASKS for t in r)
                               for r in aux_rows])
  shared = [k for k in g_tar if k not in rows]
  averages = []
  expected = numpy_algorithm_2(
      [({k: g_tar[k] for k in shared},
        [{k: g[k] for k in shared} for g in g_aux], present)] * 2, 'both',
      averages=averages)

  flat = traverse_util.flatten_dict(params, sep='/')
  state = metabalance.init(traverse_util.unflatten_dict(
      {k: v for k, v in flat.items() if k in shared}, sep='/'),
      plan.num_auxiliary)
  step = jax.jit(lambda s: trainer_lib.balanced_grads(
      model, params, s, batch, jax.random.PRNGKey(0), 1e-4, None, plan))
  # A share's gradient is a sum in another order (g); its norm, so the
  # moving averages, within g; a scale within 2g, the balanced sum within
  # 3g (`test_microbatches._metabalance_bounds`).
  g = _bound(model, 6, 9, 5)
  for want, (m_tar, m_aux) in zip(expected, averages):
    grads, state, terms = step(state)
    got = conftest.flat(grads)
    got_m_tar, got_m_aux = (conftest.flat(x) for x in state)
    for k in shared:
      conftest.assert_close_in_norm(got[k], want[k], 3 * g, k)
      conftest.assert_close_to_scale(got_m_tar[k], m_tar[k], g,
                                     np.abs(m_tar[k]), k)
      conftest.assert_close_to_scale(got_m_aux[k], m_aux[k], g,
                                     np.abs(m_aux[k]), k)
    for k in rows:  # the plain sum of every task's share
      conftest.assert_close_in_norm(
          got[k], g_tar[k] + sum(g[k] for g in g_aux),
          g + conftest.float32_bound(len(g_aux) + 1), k)
  assert 'loss' in terms


def test_relax_0_is_the_plain_step_and_none_is_unchanged(
    global_model_and_batch):
  """r = 0 rescales nothing: the step of the summed loss (to float
  rounding: the shares are summed in another order)."""
  model, params, batch = global_model_and_batch
  mesh = partitioning.create_mesh(1, 1)
  optimizer = optimizers.make_optimizer()
  states, first_plain_step = {}, None
  for name, plan in [('plain', None), ('r0', _plan(model, relax_factor=0.0))]:
    trainer = trainer_lib.Trainer(model, optimizer, mesh,
                                  {'inputs': 9, 'targets': 5},
                                  balancing=plan)
    # Copied (the step donates its state) and placed as the runner's
    # parameters are, so the second step reuses the first one's program.
    state = trainer.new_state(jax.device_put(jax.tree.map(jnp.copy, params),
                                             trainer.param_shardings))
    for i in range(2):
      state, _ = trainer.step(state, trainer.global_batch(batch))
      if name == 'plain' and i == 0:
        first_plain_step = conftest.flat(state['params'])
    states[name] = conftest.flat(state['params'])
  assert set(states['plain']) == set(states['r0'])
  # Two Adafactor steps of a gradient within g: `_assert_update_close`.
  start = conftest.flat(params)
  g = _bound(model, 6, 9, 5)
  for k, v in states['plain'].items():
    _assert_update_close(states['r0'][k], v, start[k], g, k)
  # No balancing: the step (`train_step`, as the runner compiles it) is the
  # loss's gradient through Adafactor, with the step's dropout key (each
  # side compiled: to float rounding).
  rng = jax.random.fold_in(jax.random.PRNGKey(trainer.seed), 0)

  @jax.jit
  def gradient_through_adafactor(p):
    grads = jax.grad(lambda p: trainer_lib.loss_fn(
        model, p, batch, rng, 1e-4)[0])(p)
    updates, _ = optimizer.update(grads, optimizer.init(p), p)
    return jax.tree.map(jnp.add, p, updates)

  want = conftest.flat(gradient_through_adafactor(params))
  assert set(first_plain_step) == set(want)
  for k, v in first_plain_step.items():
    _assert_update_close(v, want[k], start[k], g, k)


@pytest.mark.parametrize('auxiliaries', metabalance.AUXILIARIES)
def test_relax_0_on_packed_rows_is_the_plain_step(global_model_and_batch,
                                                  auxiliaries):
  """Packed rows (the real pipeline's, several tasks per row): the shares'
  gradients, jitted, sum to the loss's gradient. (A batched backward pass,
  `vmap` of the vjp, gets this wrong on XLA:CPU:
  `test_xla_cpu_reduces_a_broadcast_operand_rightly`.)"""
  model, params, _ = global_model_and_batch
  batch = input_pipeline.as_numpy(next(iter(input_pipeline.train_dataset(
      'fixture_glue_proportional', {'inputs': 64, 'targets': 8}, 8, seed=0,
      rows=batches.RowFormat(packed=True)))))
  tasks = np.unique(batch['decoder_task_ids'][batch['decoder_loss_weights']
                                              > 0])
  assert len(tasks) >= 3  # rows that mix tasks
  plan = _plan(model, TASKS, relax_factor=0.0, auxiliaries=auxiliaries)
  flat = traverse_util.flatten_dict(params, sep='/')
  state = metabalance.init(traverse_util.unflatten_dict(
      {k: v for k, v in flat.items() if k not in plan.task_rows}, sep='/'),
      plan.num_auxiliary)
  rng = jax.random.PRNGKey(0)
  got = jax.jit(lambda p: trainer_lib.balanced_grads(
      model, p, state, batch, rng, 1e-4, None, plan)[0])(params)
  want = jax.jit(jax.grad(lambda p: trainer_lib.loss_fn(
      model, p, batch, rng, 1e-4)[0]))(params)
  got, want = conftest.flat(got), conftest.flat(want)
  # The shares' gradients in another order, then their sum.
  bound = _bound(model, 8, 64, 8) + conftest.float32_bound(
      plan.num_auxiliary + 1)
  for k, v in want.items():
    conftest.assert_close_to_scale(got[k], v, bound, name=k)


def test_each_takes_the_papers_sixteen_auxiliaries_by_default():
  """GLUE + SuperGLUE's 17 tasks: 16 auxiliary gradients, no bound."""
  names = [f'task_{i}' for i in range(17)]
  plan = metabalance.make_plan(metabalance.Settings(target_task='task_3'),
                               names, names, ())
  assert plan.num_auxiliary == 16
  assert sorted(plan.groups) == list(range(17)) and plan.groups[3] == 0


@pytest.mark.parametrize('target, trained, settings, message', [
    ('glue_wnli', TASKS[:3], {}, "'glue_wnli' is not in the run's task"),
    ('glue_rte', TASKS[:3], {}, "'glue_rte' is not trained by the mixture"),
    ('glue_rte', ('glue_rte',), {}, 'needs auxiliary tasks'),
    ('glue_rte', TASKS, {'max_auxiliaries': 4},
     "'each' takes 7 auxiliary gradients, more than .*max_auxiliaries=4, "
     "the bound set on the step's time .* use 'all'"),
    ('glue_rte', TASKS, {'max_auxiliaries': 0},
     r'max_auxiliaries=0: a positive int, or None \(no bound\)'),
])
def test_a_plan_that_does_not_fit_is_named(target, trained, settings,
                                           message):
  with pytest.raises(ValueError, match=message):
    metabalance.make_plan(
        metabalance.Settings(target_task=target, **settings), TASKS, trained,
        ())


# ------------------------------------------ the built-in runner (train.py) --

def _train(model_dir, steps, **overrides):
  kwargs = dict(
      model_dir=str(model_dir), train_steps=steps, batch_size=4,
      mixture_or_task_name='fixture_glue_proportional',
      task_feature_lengths={'inputs': 64, 'targets': 8}, save_period=2,
      log_period=2, optimizer=optimizers.make_optimizer(),
      gradient_balancing='metabalance',
      metabalance_settings=metabalance.Settings(
          target_task='fixture_glue_rte', beta=0.5))
  kwargs.update(overrides)
  return training_loop.train(_model(),
                         settings=run_settings.RunSettings(**kwargs))


def test_a_resumed_run_reaches_the_uninterrupted_parameters(tmp_path):
  """The moving averages are part of the checkpoint: resuming from the
  run's checkpoint at step 2 (its copy, where the run stopped there) gives
  step 4's parameters bit for bit."""
  whole = _train(tmp_path / 'whole', 4)
  shutil.copytree(tmp_path / 'whole', tmp_path / 'cut',
                  ignore=shutil.ignore_patterns('checkpoint_4', 'train.lock'))
  resumed = _train(tmp_path / 'cut', 4)
  a, b = conftest.flat(whole['params']), conftest.flat(resumed['params'])
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  # Resuming the plain way (or with other settings) is refused by name.
  with pytest.raises(ValueError, match='GRADIENT_BALANCING'):
    _train(tmp_path / 'cut', 6, gradient_balancing=None)


@pytest.mark.parametrize('overrides, message', [
    ({'gradient_balancing': 'metabalnce'},
     "GRADIENT_BALANCING='metabalnce'; expected one of"),
    ({'metabalance_settings': metabalance.Settings(target_task='glue_wnli')},
     "METABALANCE_TARGET_TASK='glue_wnli' is not in the run's task list"),
    ({'metabalance_settings': metabalance.Settings(
        target_task='glue_rte', strategy='C')}, "METABALANCE_STRATEGY='C'"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path, overrides,
                                                      message):
  with pytest.raises(ValueError, match=message):
    _train(tmp_path / 'run', 2, **overrides)
  assert not (tmp_path / 'run').exists()


def test_the_record_holds_the_steps_settings_and_old_bounds_resume():
  """A run's record names the settings that change MetaBalance's step (a
  resume with another relax factor is refused); the bound on auxiliaries
  is not one of them, and a record that holds it (earlier versions wrote
  METABALANCE_MAX_AUXILIARIES = 16) resumes under today's default."""
  config = conftest.T5X_TINY_CONFIG
  settings = metabalance.Settings(target_task='glue_rte')
  now = {'GRADIENT_BALANCING': run_record.balancing_record(
      dataclasses.asdict(settings))}
  assert now['GRADIENT_BALANCING'] == {
      'METABALANCE_TARGET_TASK': 'glue_rte', 'METABALANCE_RELAX_FACTOR': 0.7,
      'METABALANCE_BETA': 0.9, 'METABALANCE_STRATEGY': 'both',
      'METABALANCE_AUXILIARIES': 'each'}
  old = run_record.make(config, {'GRADIENT_BALANCING': {
      **now['GRADIENT_BALANCING'], 'METABALANCE_MAX_AUXILIARIES': 16}}, 0)
  run_record.check_resume(old, config, now, 'checkpoint_4', [])
  other = {'GRADIENT_BALANCING': run_record.balancing_record(
      dataclasses.asdict(dataclasses.replace(settings, relax_factor=0.5)))}
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match='GRADIENT_BALANCING.*RELAX_FACTOR'):
    run_record.check_resume(old, config, other, 'checkpoint_4', [])
