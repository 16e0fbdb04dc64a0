"""MetaBalance: auxiliary tasks' gradient magnitudes adapted to the target's.

He et al., "Improving multi-task recommendations via adapting gradient
magnitudes of auxiliary tasks" (WWW 2022; Yun He's dissertation, ch. 4,
Algorithm 2, the complete version). One task is the target; the others are
auxiliaries that matter only as far as they help it. For each parameter
tensor θ separately ("balanced respectively and adaptively"), at every step:

  m_tar ← β·m_tar + (1 − β)·‖∇θ L_tar‖₂
  m_i   ← β·m_i   + (1 − β)·‖∇θ L_aux,i‖₂                  (each auxiliary i)
  G_i   ← r·G_i·m_tar / m_i + (1 − r)·G_i   where the strategy holds
  G     = G_tar + Σ_i G_i                                  (to the optimizer)

with m starting at 0 (no bias correction) and the strategies 'shrink' (only
where m_i > m_tar), 'enlarge' (only where m_i < m_tar) and 'both' (the
paper's best). Defaults r = 0.7, β = 0.9.

Two choices the paper leaves open, for batches drawn from a proportional
mixture: a task absent from the batch contributes nothing and keeps its
moving average (a zero gradient would decay m_i and blow up m_tar / m_i);
an auxiliary whose m_i is still 0 is not rescaled (no division by zero).

`balance` is pure (pytrees in, pytrees out); `balanced_gradient` takes
the per-share gradients of a loss split by task and applies it to the
shared parameters, for both runners (`trainer.train_step`, and t5x's
through `t5x_model.MetaBalanceTrainer`). This module is the pure core (jax
and flax only); `balancing.run_plan` makes a run's plan from its gin
settings, task list and mixture.
"""

import dataclasses
import functools
from typing import Any, Callable, Collection, NamedTuple, Optional, Sequence

from flax import traverse_util
import jax
import jax.numpy as jnp

GRADIENT_BALANCINGS = (None, 'metabalance')
STRATEGIES = ('shrink', 'enlarge', 'both')
AUXILIARIES = ('each', 'all')


class State(NamedTuple):
  """The moving averages of the gradient norms, per parameter tensor.

  target: a pytree of float32 scalars (m_tar of each leaf).
  auxiliary: a pytree of float32 `[K]` (m_i of each leaf).
  """
  target: Any
  auxiliary: Any


@dataclasses.dataclass(frozen=True)
class Settings:
  """MetaBalance's settings (gin: `METABALANCE_*` in `runs/train.gin`).

  target_task: the task trained for (a name of the run's task list, and a
    task the mixture samples).
  relax_factor: r in [0, 1]: 0 is plain multi-task training, 1 gives each
    auxiliary the target's magnitude.
  beta: β in [0, 1), the moving averages' decay.
  strategy: 'shrink', 'enlarge' or 'both'.
  auxiliaries: 'each' (K auxiliary gradients, the paper) or 'all' (one
    auxiliary: every other task together; 2 backward passes).
  max_auxiliaries: the most auxiliaries 'each' takes (a backward pass and a
    gradient's memory each).
  """
  target_task: Optional[str] = None
  relax_factor: float = 0.7
  beta: float = 0.9
  strategy: str = 'both'
  auxiliaries: str = 'each'
  max_auxiliaries: int = 16

  def check(self) -> None:
    """Raises ValueError naming a setting out of range."""
    if not self.target_task:
      raise ValueError("GRADIENT_BALANCING='metabalance' needs "
                       "METABALANCE_TARGET_TASK: the task to train for.")
    if isinstance(self.relax_factor, bool) or not (
        0 <= self.relax_factor <= 1):
      raise ValueError(f'METABALANCE_RELAX={self.relax_factor!r}: r must be '
                       'in [0, 1] (the paper tunes 0.1 ... 0.9; 0.7).')
    if isinstance(self.beta, bool) or not 0 <= self.beta < 1:
      raise ValueError(f'METABALANCE_BETA={self.beta!r}: β must be in '
                       '[0, 1) (the paper: 0.9).')
    if self.strategy not in STRATEGIES:
      raise ValueError(f'METABALANCE_STRATEGY={self.strategy!r}; expected '
                       f'one of {list(STRATEGIES)}.')
    if self.auxiliaries not in AUXILIARIES:
      raise ValueError(f'METABALANCE_AUXILIARIES={self.auxiliaries!r}; '
                       f'expected one of {list(AUXILIARIES)}.')


def init(target_grads: Any, num_auxiliary: int) -> State:
  """Zero moving averages for the leaves of `target_grads` (a gradient
  pytree, or its shapes) and `num_auxiliary` auxiliaries."""
  return State(
      target=jax.tree.map(lambda _: jnp.zeros((), jnp.float32), target_grads),
      auxiliary=jax.tree.map(
          lambda _: jnp.zeros((num_auxiliary,), jnp.float32), target_grads))


def _rescales(strategy: str, m_target: jax.Array, m_aux: jax.Array
              ) -> jax.Array:
  """Where the strategy rescales an auxiliary ([K] bool), never where its
  moving average is 0."""
  if strategy == 'shrink':
    holds = m_aux > m_target
  elif strategy == 'enlarge':
    holds = m_aux < m_target
  elif strategy == 'both':
    holds = m_aux != m_target
  else:
    raise ValueError(f'strategy={strategy!r}; expected one of '
                     f'{list(STRATEGIES)}.')
  return holds & (m_aux > 0)


def balance(target_grads: Any, auxiliary_grads: Sequence[Any], state: State,
            *, relax_factor: float, beta: float, strategy: str,
            present: Optional[jax.Array] = None) -> tuple[Any, State]:
  """One step of Algorithm 2 on every leaf.

  Args:
    target_grads: ∇L_tar, a gradient pytree.
    auxiliary_grads: K pytrees of the same structure, ∇L_aux,i.
    state: the moving averages (`init`).
    relax_factor: r.
    beta: β.
    strategy: 'shrink', 'enlarge' or 'both'.
    present: `[K + 1]` bool, the target first: whether each task has tokens
      in the batch (None: all). An absent task contributes nothing and keeps
      its moving average.

  Returns:
    `(G_tar + Σ_i G_i, new_state)`.
  """
  num_aux = len(auxiliary_grads)
  if present is None:
    present = jnp.ones((num_aux + 1,), bool)
  present = jnp.asarray(present, bool)

  def leaf(g_tar, m_tar, m_aux, *g_aux):
    norm = lambda g: jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))
    m_tar = jnp.where(present[0], beta * m_tar + (1 - beta) * norm(g_tar),
                      m_tar)
    norms = jnp.stack([norm(g) for g in g_aux]) if g_aux else jnp.zeros((0,))
    m_aux = jnp.where(present[1:], beta * m_aux + (1 - beta) * norms, m_aux)
    safe = jnp.where(m_aux > 0, m_aux, 1.0)
    scale = jnp.where(_rescales(strategy, m_tar, m_aux),
                      relax_factor * m_tar / safe + (1 - relax_factor), 1.0)
    scale = jnp.where(present[1:], scale, 0.0)
    total = jnp.where(present[0], g_tar, 0).astype(jnp.float32)
    for i, g in enumerate(g_aux):
      total = total + scale[i] * g.astype(jnp.float32)
    return total.astype(g_tar.dtype), m_tar, m_aux

  treedef = jax.tree.structure(target_grads)
  outputs = [leaf(*args) for args in zip(
      jax.tree.leaves(target_grads), jax.tree.leaves(state.target),
      jax.tree.leaves(state.auxiliary),
      *[jax.tree.leaves(g) for g in auxiliary_grads])]
  total, m_tar, m_aux = (jax.tree.unflatten(treedef, list(x))
                         for x in zip(*outputs))
  return total, State(target=m_tar, auxiliary=m_aux)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run balances (static: part of the compiled step).

  settings: the checked `Settings`.
  groups: per task id, its gradient: 0 the target, i in 1..K auxiliary i,
    -1 a task the mixture does not train.
  num_auxiliary: K.
  task_rows: '/'-joined paths of the parameters with a task axis: each row
    sees one task's gradient, so they take the plain sum, unbalanced.
  """
  settings: Settings
  groups: tuple[int, ...]
  num_auxiliary: int
  task_rows: frozenset[str]


def make_plan(settings: Settings, task_list: Sequence[str],
              trained_tasks: Collection[str], task_rows: Collection[str]
              ) -> Plan:
  """The plan of a run, or a ValueError naming what does not fit.

  Args:
    settings: MetaBalance's settings.
    task_list: the run's task list (a task's id is its position).
    trained_tasks: the tasks the mixture samples (rate > 0), by name.
    task_rows: the parameters with a task axis (`task_params.task_axes`).
  """
  settings.check()
  task_list = list(task_list)
  if settings.target_task not in task_list:
    raise ValueError(
        f'METABALANCE_TARGET_TASK={settings.target_task!r} is not in the '
        f"run's task list {task_list}.")
  trained = sorted({task_list.index(t) for t in trained_tasks
                    if t in task_list})
  target = task_list.index(settings.target_task)
  if target not in trained:
    raise ValueError(
        f'METABALANCE_TARGET_TASK={settings.target_task!r} is not trained by '
        'the mixture (it samples '
        f'{sorted(task_list[i] for i in trained)}): add it to the mixture.')
  auxiliary = [i for i in trained if i != target]
  if not auxiliary:
    raise ValueError('MetaBalance needs auxiliary tasks: the mixture trains '
                     f'only {settings.target_task!r}.')
  if settings.auxiliaries == 'each':
    if len(auxiliary) > settings.max_auxiliaries:
      raise ValueError(
          f"METABALANCE_AUXILIARIES='each' takes {len(auxiliary)} auxiliary "
          f'gradients (a backward pass and a gradient of memory each), more '
          f'than metabalance.Settings.max_auxiliaries='
          f"{settings.max_auxiliaries}: use 'all', or raise the bound.")
    index = {t: k + 1 for k, t in enumerate(auxiliary)}
  else:
    index = {t: 1 for t in auxiliary}
  groups = tuple(0 if i == target else index.get(i, -1)
                 for i in range(len(task_list)))
  return Plan(settings=settings, groups=groups,
              num_auxiliary=max(index.values()),
              task_rows=frozenset(task_rows))


def group_masks(plan: Plan, token_task_ids: jax.Array, num_tasks: int
                ) -> jax.Array:
  """`[batch, length, K + 1]` float: which share each target token's loss
  goes to (the target first); a task outside the plan's in none.

  Args:
    plan: the run's plan.
    token_task_ids: `[batch, length]`, the task id of each target token.
    num_tasks: the network's task-id space (ids past the plan's list are in
      no share).
  """
  groups = jnp.asarray(plan.groups + (-1,) * num_tasks, jnp.int32)
  return jax.nn.one_hot(groups[token_task_ids], plan.num_auxiliary + 1)


def shared_state_shapes(plan: Plan, params: Any) -> State:
  """The moving averages' shapes over the parameters `plan` balances
  (`params`: arrays or shapes; task-indexed ones are left out)."""
  flat = traverse_util.flatten_dict(params, sep='/')
  shared = traverse_util.unflatten_dict(
      {k: v for k, v in flat.items() if k not in plan.task_rows}, sep='/')
  return jax.eval_shape(
      functools.partial(init, num_auxiliary=plan.num_auxiliary), shared)


def balanced_gradient(shares_fn: Callable[[Any], tuple[jax.Array, Any]],
                      params: Any, state: State, plan: Plan,
                      present: jax.Array) -> tuple[Any, State, Any]:
  """MetaBalance's gradient of a loss split into the target's and each
  auxiliary's share: `(grads, new_state, aux)`.

  One forward pass (`jax.vjp`), then one backward pass per share.
  Parameters with a task axis (`plan.task_rows`) take the plain sum of the
  shares' gradients; the others are balanced (`balance`).

  Args:
    shares_fn: `params -> ([K + 1] loss shares, aux)`.
    params: the parameters (a nested dict).
    state: the moving averages (`init` over the shared parameters).
    plan: the run's plan.
    present: `[K + 1]` bool, whether each share has tokens in the batch.
  """
  num_groups = plan.num_auxiliary + 1
  loss_shares, vjp_fn, aux = jax.vjp(shares_fn, params, has_aux=True)
  # The backward passes in sequence (`lax.map`: one pass in the compiled
  # graph whatever K). Not `vmap`: under jit (jax 0.10.2, CPU) the batched
  # backward pass of the packed model gave wrong gradients
  # (test_relax_0_on_packed_rows_is_the_plain_step catches it).
  (grads,) = jax.lax.map(vjp_fn,
                         jnp.eye(num_groups, dtype=loss_shares.dtype))
  flat = traverse_util.flatten_dict(grads, sep='/')
  rows = {k: g.sum(0) for k, g in flat.items() if k in plan.task_rows}
  shared = {k: g for k, g in flat.items() if k not in plan.task_rows}
  nest = functools.partial(traverse_util.unflatten_dict, sep='/')
  settings = plan.settings
  total, state = balance(
      nest({k: g[0] for k, g in shared.items()}),
      [nest({k: g[i] for k, g in shared.items()})
       for i in range(1, num_groups)],
      state, relax_factor=settings.relax_factor, beta=settings.beta,
      strategy=settings.strategy, present=present)
  total = traverse_util.flatten_dict(total, sep='/')
  return nest({**total, **rows}), state, aux
