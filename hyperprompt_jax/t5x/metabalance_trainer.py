"""MetaBalance in t5x: a t5x `Trainer` taking MetaBalance's gradient."""

from typing import Any, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
from t5x import trainer as t5x_trainer

from hyperprompt_jax.t5x import t5x_model
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import trainer


class MetaBalanceTrainer(t5x_trainer.Trainer):
  """t5x's `Trainer` taking MetaBalance's gradient (gin/t5x/metabalance.gin).

  Same arguments as t5x's. With a `TaskIdsEncoderDecoderModel` holding a
  plan, each step splits t5x's loss by each target token's task into shares
  (`loss_shares`), balances their gradients on the shared parameters
  (`metabalance.balanced_gradient`) and applies the sum as t5x does
  (`trainer.apply_grads`); the moving averages are the train state's flax
  mutables. Without a plan it takes t5x's plain step. With
  `num_microbatches` > 1, each share's gradient is the whole batch's, summed
  over the built-in runner's parts (`balanced_gradient_in_parts`), so the
  step is the one-batch step.
  """

  def __init__(self, model: t5x_model.TaskIdsEncoderDecoderModel,
               train_state: Any,
               partitioner: Any, eval_names: Any, summary_dir: Any,
               train_state_axes: Any, rng: jax.Array, learning_rate_fn: Any,
               num_microbatches: Optional[int],
               weight_metrics_computer: Any = None):
    super().__init__(
        model=model, train_state=train_state, partitioner=partitioner,
        eval_names=eval_names, summary_dir=summary_dir,
        train_state_axes=train_state_axes, rng=rng,
        learning_rate_fn=learning_rate_fn, num_microbatches=num_microbatches,
        weight_metrics_computer=weight_metrics_computer)

  def _balanced_step(self, train_state: Any, batch: Mapping[str, jax.Array]):
    model = self._model
    plan = model.balancing
    mutables = flax.core.unfreeze(train_state.flax_mutables)
    state = metabalance.State(**mutables[t5x_model.METABALANCE])
    weights = batch['decoder_loss_weights'].astype(jnp.float32)
    in_share = metabalance.group_masks(plan, model.token_task_ids(batch),
                                       model.module.config.num_tasks)
    present = jnp.einsum('bl,blg->g', weights, in_share) > 0
    rng = self._get_step_rng(train_state.step)
    params = flax.core.unfreeze(train_state.params)
    n = self._num_microbatches or 1
    if n == 1:
      grads, state, metrics = metabalance.balanced_gradient(
          lambda params: model.loss_shares(params, batch, rng, in_share),
          params, state, plan, present)
    else:
      parts = trainer.microbatches(batch, n)
      in_parts = trainer.microbatches({'in_share': in_share}, n)
      factor = model.batch_factor(batch)

      def part_shares(params, i):
        return model.loss_shares(
            params, {k: v[i] for k, v in parts.items()},
            jax.random.fold_in(rng, i), in_parts['in_share'][i], factor)

      grads, state, metrics = metabalance.balanced_gradient_in_parts(
          part_shares, n, params, state, plan, present,
          t5x_trainer.merge_metrics)
    mutables[t5x_model.METABALANCE] = state._asdict()
    if isinstance(train_state.params, flax.core.FrozenDict):
      grads = flax.core.freeze(grads)  # the optimizer's tree structure
    return t5x_trainer.apply_grads(
        train_state, grads, metrics,
        self._learning_rate_fn(train_state.step),
        self._weight_metrics_computer,
        other_state_variables={'flax_mutables': flax.core.freeze(mutables)})

  @t5x_trainer.cached_property
  def _partitioned_train_step(self):
    if getattr(self._model, 'balancing', None) is None:
      return super()._partitioned_train_step
    return self._partitioner.partition(
        self._balanced_step,
        in_axis_resources=(self._train_state_axes,
                           self._partitioner.data_partition_spec),
        out_axis_resources=(self._train_state_axes, None),
        donate_argnums=(0,))
