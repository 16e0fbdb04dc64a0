"""The train state and the sharded train step of the built-in runner.

The state is a dict `{'step', 'params', 'opt_state'}` (an orbax-friendly
PyTree). Parameters are placed by their logical axes (`partitioning`), the
optimizer state by the compiler from them, and the batch along 'data'; the
step is one `jax.jit` of the pure `train_step` (which the benchmark times
too) with those in / out shardings, donating the old state.
"""

import functools
from typing import Any, Callable, Mapping, Optional

from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hyperprompt_jax.common import multihost
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import inputs as inputs_lib
from hyperprompt_jax.t5 import losses
from hyperprompt_jax.training import metabalance

State = dict[str, Any]
# The state's key for MetaBalance's moving averages (present with balancing
# only: a run without it has the plain state and checkpoints).
METABALANCE = 'metabalance'


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
  """The network's keyword arguments beside the tokens: task and segment ids."""
  if inputs_lib.is_packed(batch):
    return {k: batch[k] for k in inputs_lib.PACKING_FEATURES}
  return {'task_ids': batch['task_ids']}


def loss_fn(model: network.Transformer, params: Any, batch: Mapping[str, Any],
            rng: jax.Array, z_loss: float,
            rules: Optional[partitioning.AxisRules] = None
            ) -> tuple[jax.Array, dict]:
  """Teacher-forced cross-entropy + z-loss of a batch.

  Args:
    model: the network.
    params: its parameters.
    batch: unpacked or packed rows (`inputs_lib.required_features`).
    rng: the dropout key.
    z_loss: the z-loss coefficient.
    rules: logical axis rules; None: `partitioning.logical_axis_rules()`.

  Returns:
    `(loss, terms)`: `losses.cross_entropy_with_z_loss`'s, normalised over
    the real target tokens, with the per-task sums.
  """
  terms = losses.cross_entropy_with_z_loss(
      _logits(model, params, batch, rng, rules),
      batch['decoder_target_tokens'], batch['decoder_loss_weights'], z_loss,
      target_task_ids(batch), model.config.num_tasks)
  return terms['loss'], terms


def _logits(model, params, batch, rng, rules) -> jax.Array:
  """Teacher-forced logits with dropout, under the axis rules."""
  with nn_partitioning.axis_rules(rules or partitioning.logical_axis_rules()):
    return model.apply(
        {'params': params}, batch['encoder_input_tokens'],
        batch['decoder_input_tokens'], batch['decoder_target_tokens'],
        enable_dropout=True, rngs={'dropout': rng}, **model_inputs(batch))


def target_task_ids(batch: Mapping[str, Any]) -> jax.Array:
  """The task id of each target token, `[batch, target_length]`."""
  if inputs_lib.is_packed(batch):
    return batch['decoder_task_ids']
  return jnp.broadcast_to(batch['task_ids'][:, None],
                          batch['decoder_target_tokens'].shape)


def check_num_microbatches(num_microbatches: Optional[int],
                           shard_batch: int) -> int:
  """NUM_MICROBATCHES as a count of parts.

  Args:
    num_microbatches: the setting; None: 1.
    shard_batch: the rows of one data shard (BATCH_SIZE / the mesh's data
      shards): every part takes the same number of each shard's rows.

  Returns:
    The number of parts.

  Raises:
    ValueError: not a positive integer, or not a divisor of `shard_batch`.
  """
  if num_microbatches is None:
    return 1
  if (isinstance(num_microbatches, bool) or
      not isinstance(num_microbatches, int) or num_microbatches < 1):
    raise ValueError(f'NUM_MICROBATCHES={num_microbatches!r}: expected None '
                     'or a positive integer (the parts each batch is taken '
                     'in).')
  if shard_batch % num_microbatches:
    raise ValueError(
        f'NUM_MICROBATCHES={num_microbatches} does not divide the '
        f'{shard_batch} rows of each data shard (BATCH_SIZE / the mesh\'s '
        'data shards): choose a divisor, or change BATCH_SIZE.')
  return num_microbatches


def microbatches(batch: Mapping[str, Any], n: int) -> dict[str, jax.Array]:
  """`[B, ...]` -> `[n, B / n, ...]`, part i holding rows i, n + i, ...

  Each part keeps the batch's spread over the data shards: no rows move.
  """
  return {k: jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)
          for k, x in batch.items()}


def _zero_sums(num_tasks: int) -> dict[str, jax.Array]:
  """Zeros of `losses.weighted_sums`' dict."""
  return {**{k: jnp.zeros((), jnp.float32)
             for k in ('cross_entropy', 'z_loss', 'hits', 'tokens')},
          **{k: jnp.zeros((num_tasks,), jnp.float32)
             for k in ('task_loss', 'task_hits', 'task_tokens')}}


def microbatched_grads(model: network.Transformer, params: Any,
                       batch: Mapping[str, Any], rng: jax.Array,
                       z_loss: float, rules: Optional[partitioning.AxisRules],
                       num_microbatches: int) -> tuple[tuple[jax.Array, dict],
                                                       Any]:
  """`((loss, terms), grads)` of the batch taken in parts, one by one.

  As t5x's `num_microbatches`: the gradients are summed, and each part's
  loss is over the whole batch's real target tokens, so the result is the
  one-batch loss and gradient with one part's activations in memory. Part i
  holds `microbatches`' rows, and dropout key `fold_in(rng, i)`.
  """
  n = num_microbatches
  tokens = jnp.maximum(
      batch['decoder_loss_weights'].astype(jnp.float32).sum(), 1.0)

  def part_loss(params, part, rng):
    sums = losses.weighted_sums(
        _logits(model, params, part, rng, rules),
        part['decoder_target_tokens'], part['decoder_loss_weights'], z_loss,
        target_task_ids(part), model.config.num_tasks)
    return (sums['cross_entropy'] + sums['z_loss']) / tokens, sums

  grad_fn = jax.value_and_grad(part_loss, has_aux=True)

  def add_part(carry, inputs):
    i, part = inputs
    (_, sums), grads = grad_fn(params, part, jax.random.fold_in(rng, i))
    return jax.tree.map(jnp.add, carry, (grads, sums)), None

  zeros = (jax.tree.map(jnp.zeros_like, params),
           _zero_sums(model.config.num_tasks))
  (grads, sums), _ = jax.lax.scan(
      add_part, zeros, (jnp.arange(n), microbatches(batch, n)))
  terms = losses.terms_from_sums(sums)
  return (terms['loss'], terms), grads


def _loss_shares(model, params, batch, rng, rules, z_loss, plan, tokens
                 ) -> tuple[jax.Array, dict]:
  """`([K + 1] loss shares, losses.weighted_sums)` of a batch or a part.

  Each share is its tokens' loss sum over `tokens`, the whole batch's real
  target tokens.
  """
  weights = batch['decoder_loss_weights'].astype(jnp.float32)
  task_ids = target_task_ids(batch)
  in_group = metabalance.group_masks(plan, task_ids, model.config.num_tasks)
  logits = _logits(model, params, batch, rng, rules)
  targets = batch['decoder_target_tokens']
  sums = losses.weighted_sums(logits, targets, weights, z_loss, task_ids,
                              model.config.num_tasks)
  cross_entropy, z_term = losses.token_losses(logits, targets, z_loss)
  per_token = (cross_entropy + z_term) * weights
  return jnp.einsum('bl,blg->g', per_token, in_group) / tokens, sums


def balanced_grads(model: network.Transformer, params: Any, balance: Any,
                   batch: Mapping[str, Any], rng: jax.Array, z_loss: float,
                   rules: Optional[partitioning.AxisRules],
                   plan: metabalance.Plan, num_microbatches: int = 1
                   ) -> tuple[Any, Any, dict]:
  """MetaBalance's gradient: `(grads, new balance state, terms)`.

  The loss is split by each target token's task into the target's and each
  auxiliary's share (over all real target tokens, so the shares sum to the
  loss), whose gradients `metabalance.balanced_gradient` balances. With
  microbatches each share's gradient is summed over `microbatched_grads`'
  parts, so the step is the one-batch step.
  """
  weights = batch['decoder_loss_weights'].astype(jnp.float32)
  tokens = jnp.maximum(weights.sum(), 1.0)
  in_group = metabalance.group_masks(plan, target_task_ids(batch),
                                     model.config.num_tasks)
  present = jnp.einsum('bl,blg->g', weights, in_group) > 0
  shares = functools.partial(_loss_shares, model, rules=rules, z_loss=z_loss,
                             plan=plan, tokens=tokens)
  if num_microbatches == 1:
    grads, state, sums = metabalance.balanced_gradient(
        lambda params: shares(params, batch, rng), params, balance, plan,
        present)
  else:
    parts = microbatches(batch, num_microbatches)
    grads, state, sums = metabalance.balanced_gradient_in_parts(
        lambda params, i: shares(
            params, jax.tree.map(lambda x: x[i], parts),
            jax.random.fold_in(rng, i)),
        num_microbatches, params, balance, plan, present)
  return grads, state, losses.terms_from_sums(sums)


def train_step(model: network.Transformer,
               optimizer: optax.GradientTransformation, state: State,
               batch: Mapping[str, Any], rng: jax.Array, z_loss: float,
               rules: Optional[partitioning.AxisRules] = None,
               balancing: Optional[metabalance.Plan] = None,
               num_microbatches: int = 1) -> tuple[State, dict]:
  """One optimizer step, pure: jit it with the shardings you need.

  A non-finite loss or update leaves the state as it was, so no NaN reaches
  a checkpoint; `terms['finite']` says so and the runner stops.

  Args:
    model: the network.
    optimizer: an optax transformation.
    state: `{'step', 'params', 'opt_state'}`, with balancing also
      MetaBalance's moving averages under 'metabalance'.
    batch: global arrays, unpacked or packed rows.
    rng: the dropout key.
    z_loss: the z-loss coefficient.
    rules: logical axis rules; None: `partitioning.logical_axis_rules()`.
    balancing: MetaBalance's plan (`balanced_grads`); None: plain gradient.
    num_microbatches: parts the batch's gradient is taken in
      (`microbatched_grads`).

  Returns:
    `(new state, terms)`: the loss terms, 'finite', and the run's curves
    (gradient norm, real input tokens, capacity, examples).
  """
  new = {}
  if balancing is not None:
    grads, new[METABALANCE], terms = balanced_grads(
        model, state['params'], state[METABALANCE], batch, rng, z_loss,
        rules, balancing, num_microbatches)
    loss = terms['loss']
  elif num_microbatches > 1:
    (loss, terms), grads = microbatched_grads(
        model, state['params'], batch, rng, z_loss, rules, num_microbatches)
  else:
    (loss, terms), grads = jax.value_and_grad(loss_fn, argnums=1,
                                              has_aux=True)(
        model, state['params'], batch, rng, z_loss, rules)
  updates, opt_state = optimizer.update(grads, state['opt_state'],
                                        state['params'])
  new.update({'step': state['step'] + 1,
              'params': optax.apply_updates(state['params'], updates),
              'opt_state': opt_state})
  finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(updates))
  new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
  terms['finite'] = finite
  # The run's curves, written at LOG_PERIOD: the gradient's norm before the
  # optimizer, real tokens and the rows' capacity (tokens/s, packing
  # efficiency), and the examples the rows hold.
  terms['grad_norm'] = optax.tree.norm(grads)
  terms['input_tokens'] = (batch['encoder_input_tokens'] > 0).sum()
  terms['capacity'] = (batch['encoder_input_tokens'].size
                       + batch['decoder_target_tokens'].size)
  terms['examples'] = examples(batch)
  return new, terms


def examples(batch: Mapping[str, Any]) -> jax.Array:
  """The examples a batch holds (packed: each row's largest segment id)."""
  if inputs_lib.is_packed(batch):
    return batch['decoder_segment_ids'].max(axis=1).sum()
  return (batch['decoder_loss_weights'].sum(axis=1) > 0).sum()


class Trainer:
  """Builds, restores and steps the sharded train state.

  Args:
    model: the network.
    optimizer: an optax transformation (`optimizers.make_optimizer`).
    mesh: the ('data', 'model') device mesh.
    task_feature_lengths: {'inputs': L_in, 'targets': L_out}.
    z_loss: the z-loss coefficient.
    seed: parameter initialisation and dropout (`fold_in(seed, step)`).
    rules: logical axis rules (default: t5x's standard + the project's).
    balancing: MetaBalance's plan (None: the plain gradient).
    num_microbatches: the parts each batch's gradient is taken in
      (`microbatched_grads`; None or 1: the whole batch at once).
    checked_on_host: every batch `step` gets was checked on the host
      (`batches.validate_batch`, as the built-in runner does): the step is
      compiled without the network's own check (`network.checked_on_host`).
  """

  def __init__(self, model: network.Transformer,
               optimizer: optax.GradientTransformation,
               mesh: jax.sharding.Mesh,
               task_feature_lengths: Mapping[str, int], z_loss: float = 1e-4,
               seed: int = 0, rules: Optional[partitioning.AxisRules] = None,
               balancing: Optional[metabalance.Plan] = None,
               num_microbatches: Optional[int] = None,
               checked_on_host: bool = False):
    self.model = model
    self._step_model = (network.checked_on_host(model) if checked_on_host
                        else model)
    self.balancing = balancing
    self.num_microbatches = num_microbatches or 1
    self.optimizer = optimizer
    self.mesh = mesh
    self.rules = rules or partitioning.logical_axis_rules()
    self.z_loss = z_loss
    self.seed = seed
    self.batch_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec('data'))
    self.data_layout = multihost.data_layout(mesh)
    self._lengths = (task_feature_lengths['inputs'],
                     task_feature_lengths['targets'])
    abstract = network.abstract_variables(model, *self._lengths)
    self.abstract_params = abstract['params']
    self.param_shardings = partitioning.parameter_shardings(
        abstract['params_axes'], mesh, self.rules)
    self._step_fn = None
    self.state_shardings = None

  # -- building the state ----------------------------------------------------

  def fresh_params(self) -> Any:
    """Freshly initialised parameters, placed by their logical axes."""
    init = jax.jit(
        lambda rng: network.init_variables(self.model, rng,
                                           *self._lengths)['params'],
        out_shardings=self.param_shardings)
    with jax.set_mesh(self.mesh), nn_partitioning.axis_rules(self.rules):
      return init(jax.random.PRNGKey(self.seed))

  def _shardings(self) -> State:
    """Where the state lives, found by compiling, without allocating.

    Parameters by their logical axes, the optimizer state where the compiler
    puts `optimizer.init`'s outputs, the step replicated.
    """
    if self.state_shardings is None:
      params = jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
          self.abstract_params, self.param_shardings)
      opt = jax.jit(self.optimizer.init).lower(params).compile()
      replicated = jax.sharding.NamedSharding(self.mesh,
                                              jax.sharding.PartitionSpec())
      # Outputs not derived from a parameter (step counters) come back on
      # one device; replicate them over the mesh instead.
      opt_shardings = jax.tree.map(
          lambda s: s if isinstance(s, jax.sharding.NamedSharding)
          else replicated, opt.output_shardings)
      self.state_shardings = {'step': replicated,
                              'params': self.param_shardings,
                              'opt_state': opt_shardings}
      if self.balancing is not None:  # a few floats per parameter tensor
        self.state_shardings[METABALANCE] = jax.tree.map(
            lambda _: replicated, self._abstract_balance())
    return self.state_shardings

  def _abstract_balance(self) -> metabalance.State:
    """MetaBalance's moving averages, over the parameters it balances."""
    return metabalance.shared_state_shapes(self.balancing,
                                           self.abstract_params)

  def new_state(self, params: Any) -> State:
    """Step 0 and fresh optimizer state around `params`."""
    shardings = self._shardings()
    opt_state = jax.jit(self.optimizer.init,
                        out_shardings=shardings['opt_state'])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings['step'])
    state = {'step': step, 'params': params, 'opt_state': opt_state}
    if self.balancing is not None:
      state[METABALANCE] = jax.device_put(
          jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                       self._abstract_balance()), shardings[METABALANCE])
    return state

  def abstract_state(self) -> State:
    """Shapes, dtypes and shardings of the state (for restoring)."""
    abstract = {'step': jax.ShapeDtypeStruct((), jnp.int32),
                'params': self.abstract_params,
                'opt_state': jax.eval_shape(self.optimizer.init,
                                            self.abstract_params)}
    if self.balancing is not None:
      abstract[METABALANCE] = self._abstract_balance()
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, self._shardings())

  # -- stepping ----------------------------------------------------------------

  def global_batch(self, local: Mapping[str, np.ndarray]) -> dict:
    """This host's numpy batch -> global arrays sharded along 'data'.

    The host's rows are its data shard's (`multihost.data_layout`); hosts
    that share a shard give the same rows.
    """
    shards = self.data_layout.num_shards
    return {k: jax.make_array_from_process_local_data(
                self.batch_sharding, local[k],
                (shards * local[k].shape[0],) + local[k].shape[1:])
            for k in inputs_lib.required_features(inputs_lib.is_packed(local))}

  def _step(self, state: State, batch: dict) -> tuple[State, dict]:
    """`train_step` with the step's dropout key."""
    rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), state['step'])
    return train_step(self._step_model, self.optimizer, state, batch, rng,
                      self.z_loss, self.rules, self.balancing,
                      self.num_microbatches)

  def step_function(self) -> Callable:
    """The jitted `(state, global batch) -> (state, metrics)`, donating.

    `.lower(abstract_state(), batch shapes)` compiles it for any mesh, a
    TPU slice's from `jax.experimental.topologies` included.
    """
    if self._step_fn is None:
      shardings = self._shardings()
      self._step_fn = jax.jit(
          self._step,
          in_shardings=(shardings, self.batch_sharding),
          out_shardings=(shardings, None),
          donate_argnums=(0,))
    return self._step_fn

  def step(self, state: State, batch: dict) -> tuple[State, dict]:
    """One optimizer step on a global batch (`global_batch`)."""
    step_fn = self.step_function()
    with jax.set_mesh(self.mesh):
      return step_fn(state, batch)

  def loss_fn(self) -> Callable:
    """`(params, global_batch, rng) -> (loss, terms)`, for tests."""
    return functools.partial(loss_fn, self.model, z_loss=self.z_loss,
                             rules=self.rules)
