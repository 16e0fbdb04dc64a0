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
an auxiliary whose m_i is still 0 is not rescaled.

The pure core (jax and flax only): `add_share` / `balance` on gradient
pytrees; `balance_shares` over the shares' gradients taken one by one, fed
by `balanced_gradient` (one batch) and `balanced_gradient_in_parts`
(microbatches), for `trainer.train_step` and t5x's
`metabalance_trainer.MetaBalanceTrainer`. `metabalance_plan.run_plan` makes a
run's plan from its settings, task list and mixture.
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

  Attributes:
    target: a pytree of float32 scalars, each leaf's m_tar.
    auxiliary: a pytree of float32 `[K]`, each leaf's m_i.
  """
  target: Any
  auxiliary: Any


@dataclasses.dataclass(frozen=True)
class Settings:
  """MetaBalance's settings (gin: `METABALANCE_*` in `runs/train.gin`).

  Attributes:
    target_task: the task trained for (in the run's task list and sampled by
      the mixture).
    relax_factor: r in [0, 1]: 0 is plain multi-task training, 1 gives each
      auxiliary the target's magnitude.
    beta: β in [0, 1), the moving averages' decay.
    strategy: 'shrink', 'enlarge' or 'both'.
    auxiliaries: 'each' (K auxiliary gradients, the paper) or 'all' (one
      auxiliary: every other task together; 2 backward passes).
    max_auxiliaries: the most auxiliaries 'each' may take (None: no bound), a
      guard on the step's time: each is one more backward pass. Memory sets
      no bound: the step holds about three gradients whatever K.
  """
  target_task: Optional[str] = None
  relax_factor: float = 0.7
  beta: float = 0.9
  strategy: str = 'both'
  auxiliaries: str = 'each'
  max_auxiliaries: Optional[int] = None

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
    if self.max_auxiliaries is not None and (
        isinstance(self.max_auxiliaries, bool)
        or not isinstance(self.max_auxiliaries, int)
        or self.max_auxiliaries < 1):
      raise ValueError(
          f'metabalance.Settings.max_auxiliaries={self.max_auxiliaries!r}: '
          'a positive int, or None (no bound).')


def init(target_grads: Any, num_auxiliary: int) -> State:
  """Zero moving averages for the leaves of `target_grads` and K auxiliaries."""
  return State(
      target=jax.tree.map(lambda _: jnp.zeros((), jnp.float32), target_grads),
      auxiliary=jax.tree.map(
          lambda _: jnp.zeros((num_auxiliary,), jnp.float32), target_grads))


def _rescales(strategy: str, m_target: jax.Array, m_aux: jax.Array
              ) -> jax.Array:
  """Where the strategy rescales an auxiliary, never where m_aux is 0."""
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


def _norm(g: jax.Array) -> jax.Array:
  """‖g‖₂ in float32."""
  return jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))


def _add_leaf_share(share: jax.Array, g: jax.Array, total: jax.Array,
                    m_tar: jax.Array, m_aux: jax.Array, present: jax.Array,
                    *, relax_factor: float, beta: float, strategy: str
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Algorithm 2 for one share's gradient of one tensor.

  Updates the share's moving average, rescales `g` and adds it to `total`;
  returns `(total, m_tar, m_aux)`. The target's share (0) must come first: an
  auxiliary's scale reads the updated m_tar.
  """
  is_target = share == 0
  here = present[share]
  norm = _norm(g)
  m_tar = jnp.where(is_target & here, beta * m_tar + (1 - beta) * norm,
                    m_tar)
  slot = jnp.maximum(share - 1, 0)
  m_i = m_aux[slot]
  m_i = jnp.where(~is_target & here, beta * m_i + (1 - beta) * norm, m_i)
  m_aux = jnp.where(is_target, m_aux, m_aux.at[slot].set(m_i))
  safe = jnp.where(m_i > 0, m_i, 1.0)
  scale = jnp.where(_rescales(strategy, m_tar, m_i),
                    relax_factor * m_tar / safe + (1 - relax_factor), 1.0)
  scale = jnp.where(is_target, 1.0, scale)
  total = total + jnp.where(here, scale * g.astype(jnp.float32), 0.0)
  return total, m_tar, m_aux


def add_share(share: jax.Array, grads: Any, total: Any, state: State, *,
              relax_factor: float, beta: float, strategy: str,
              present: jax.Array) -> tuple[Any, State]:
  """One share's step of Algorithm 2 on every leaf: `(total + G_share, state)`.

  `share` (int, may be traced): 0 the target, which must come first (its m_tar
  scales the others), i in 1..K auxiliary i; `grads`: its gradient pytree;
  `total`: the float32 running total (zeros before the target's share); the
  rest as `balance`'s.
  """
  leaf = functools.partial(_add_leaf_share, jnp.asarray(share, jnp.int32),
                           relax_factor=relax_factor, beta=beta,
                           strategy=strategy,
                           present=jnp.asarray(present, bool))
  trees = (total, state.target, state.auxiliary)
  outputs = [leaf(*args) for args in zip(
      jax.tree.leaves(grads), *map(jax.tree.leaves, trees))]
  total, m_tar, m_aux = (jax.tree.unflatten(jax.tree.structure(tree), list(x))
                         for tree, x in zip(trees, zip(*outputs)))
  return total, State(target=m_tar, auxiliary=m_aux)


def balance(target_grads: Any, auxiliary_grads: Sequence[Any], state: State,
            *, relax_factor: float, beta: float, strategy: str,
            present: Optional[jax.Array] = None) -> tuple[Any, State]:
  """One step of Algorithm 2 on every leaf, from every share's gradient at once.

  Args:
    target_grads: ∇L_tar, a gradient pytree.
    auxiliary_grads: K pytrees of the same structure, ∇L_aux,i.
    state: the moving averages (`init`).
    relax_factor: r.
    beta: β.
    strategy: 'shrink', 'enlarge' or 'both'.
    present: `[K + 1]` bool, the target first: whether each task has tokens
      in the batch (None: all).

  Returns:
    `(G_tar + Σ_i G_i, new_state)`, in `target_grads`' dtypes.
  """
  if present is None:
    present = jnp.ones((len(auxiliary_grads) + 1,), bool)
  total = jax.tree.map(lambda g: jnp.zeros(jnp.shape(g), jnp.float32),
                       target_grads)
  for share, grads in enumerate([target_grads, *auxiliary_grads]):
    total, state = add_share(share, grads, total, state,
                             relax_factor=relax_factor, beta=beta,
                             strategy=strategy, present=present)
  return jax.tree.map(lambda t, g: t.astype(jnp.result_type(g)), total,
                      target_grads), state


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run balances (static: part of the compiled step).

  Attributes:
    settings: the checked `Settings`.
    groups: per task id, its gradient: 0 the target, i in 1..K auxiliary i,
      -1 a task the mixture does not train.
    num_auxiliary: K.
    task_rows: '/'-paths of the parameters with a task axis: each row sees
      one task's gradient, so they take the plain sum, unbalanced.
  """
  settings: Settings
  groups: tuple[int, ...]
  num_auxiliary: int
  task_rows: frozenset[str]


def make_plan(settings: Settings, task_list: Sequence[str],
              trained_tasks: Collection[str], task_rows: Collection[str]
              ) -> Plan:
  """The plan of a run.

  Args:
    settings: MetaBalance's settings.
    task_list: the run's task list (a task's id is its position).
    trained_tasks: the tasks the mixture samples (rate > 0), by name.
    task_rows: the parameters with a task axis (`task_params.task_axes`).

  Returns:
    The `Plan`.

  Raises:
    ValueError: a setting out of range, a target task not in the list or
      not trained, no auxiliaries, or more than `max_auxiliaries`.
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
    if (settings.max_auxiliaries is not None
        and len(auxiliary) > settings.max_auxiliaries):
      raise ValueError(
          f"METABALANCE_AUXILIARIES='each' takes {len(auxiliary)} auxiliary "
          f'gradients, more than metabalance.Settings.max_auxiliaries='
          f'{settings.max_auxiliaries}, the bound set on the step\'s time '
          f'({len(auxiliary) + 1} backward passes; its memory does not grow '
          "with them): use 'all' (2 backward passes), or raise or unset "
          '(None) the bound.')
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
  """`[batch, length, K + 1]` float: the share each target token's loss goes to.

  The target first; a task outside the plan (`token_task_ids [batch, length]`
  past its list, up to `num_tasks`) is in none.
  """
  groups = jnp.asarray(plan.groups + (-1,) * num_tasks, jnp.int32)
  return jax.nn.one_hot(groups[token_task_ids], plan.num_auxiliary + 1)


def shared_state_shapes(plan: Plan, params: Any) -> State:
  """The moving averages' shapes over the parameters `plan` balances."""
  flat = traverse_util.flatten_dict(params, sep='/')
  shared = traverse_util.unflatten_dict(
      {k: v for k, v in flat.items() if k not in plan.task_rows}, sep='/')
  return jax.eval_shape(
      functools.partial(init, num_auxiliary=plan.num_auxiliary), shared)


def balance_shares(share_grads: Callable[[jax.Array], tuple[Any, Any]],
                   params: Any, state: State, plan: Plan, present: jax.Array
                   ) -> tuple[Any, State, Any]:
  """Algorithm 2 over the K + 1 shares' gradients taken one after the other.

  A `lax.scan` over the shares, the target's first: each share's gradient is
  added to running totals as soon as it is taken (`add_share`), so the loop
  holds about three gradients whatever K, not the K + 1 gradients stacked.
  Algorithm 2 allows the order: an auxiliary's scale needs only its own norm
  and the target's average. Parameters with a task axis (`plan.task_rows`)
  take the plain sum.

  Args:
    share_grads: `share -> (gradient of that share's loss, aux)`, share an
      int32 scalar, traced (0 the target, i in 1..K auxiliary i).
    params: the parameters (a nested dict; arrays or shapes).
    state: the moving averages (`init` over the shared parameters).
    plan: the run's plan.
    present: `[K + 1]` bool, whether each share has tokens in the batch.

  Returns:
    `(grads, new_state, aux of the target's share)`.
  """
  settings = plan.settings
  flat = traverse_util.flatten_dict(params, sep='/')
  nest = functools.partial(traverse_util.unflatten_dict, sep='/')
  rows_of = lambda tree: {k: v for k, v in tree.items()
                          if k in plan.task_rows}
  shared_of = lambda tree: nest({k: v for k, v in tree.items()
                                 if k not in plan.task_rows})

  def add(carry, share):
    shared_total, rows_total, state = carry
    grads, aux = share_grads(share)
    grads = traverse_util.flatten_dict(grads, sep='/')
    shared_total, state = add_share(
        share, shared_of(grads), shared_total, state,
        relax_factor=settings.relax_factor, beta=settings.beta,
        strategy=settings.strategy, present=present)
    rows_total = jax.tree.map(jnp.add, rows_total, rows_of(grads))
    return (shared_total, rows_total, state), aux

  zeros = ({k: jnp.zeros(v.shape, jnp.float32) for k, v in flat.items()
            if k not in plan.task_rows},
           {k: jnp.zeros(v.shape, v.dtype) for k, v in rows_of(flat).items()})
  (shared_total, rows_total, state), aux = jax.lax.scan(
      add, (nest(zeros[0]), zeros[1], state),
      jnp.arange(plan.num_auxiliary + 1, dtype=jnp.int32))
  shared_total = {k: v.astype(flat[k].dtype) for k, v in
                  traverse_util.flatten_dict(shared_total, sep='/').items()}
  return (nest({**shared_total, **rows_total}), state,
          jax.tree.map(lambda a: a[0], aux))


def balanced_gradient(shares_fn: Callable[[Any], tuple[jax.Array, Any]],
                      params: Any, state: State, plan: Plan,
                      present: jax.Array) -> tuple[Any, State, Any]:
  """MetaBalance's gradient of a loss split into shares by task.

  One forward pass (`jax.vjp`), then one backward pass per share, balanced as
  it is taken (`balance_shares`). Not `jax.vmap` over the cotangents: it would
  hold the K + 1 gradients at once, and XLA:CPU (jaxlib 0.10.2) miscompiles
  such batched backward passes (`tests/test_metabalance.py`).

  Args:
    shares_fn: `params -> ([K + 1] loss shares, aux)`.
    params: the parameters (a nested dict).
    state: the moving averages (`init` over the shared parameters).
    plan: the run's plan.
    present: `[K + 1]` bool, whether each share has tokens in the batch.

  Returns:
    `(grads, new_state, aux)`.
  """
  loss_shares, vjp_fn, aux = jax.vjp(shares_fn, params, has_aux=True)

  def share_grads(share):
    (grads,) = vjp_fn(jax.nn.one_hot(share, plan.num_auxiliary + 1,
                                     dtype=loss_shares.dtype))
    return grads, ()

  grads, state, _ = balance_shares(share_grads, params, state, plan, present)
  return grads, state, aux


def balanced_gradient_in_parts(
    part_shares_fn: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    num_parts: int, params: Any, state: State, plan: Plan,
    present: jax.Array, merge_aux: Optional[Callable[[Any, Any], Any]] = None
    ) -> tuple[Any, State, Any]:
  """MetaBalance's gradient of a batch taken in `num_parts` microbatches.

  Each share's gradient is the whole batch's (its parts' summed before
  `add_share`), so the step is the one-batch step. Shares outer, parts inner:
  one more gradient than the one-batch form and one part's activations in
  memory, for (K + 1) x `num_parts` forward and backward passes (parts outer
  would hold K + 1 accumulators).

  Args:
    part_shares_fn: `(params, part index) -> ([K + 1] loss shares, aux)`,
      each share over the whole batch's normaliser so the parts' sum to the
      batch's.
    num_parts: the number of parts.
    params: the parameters (a nested dict).
    state: the moving averages (`init` over the shared parameters).
    plan: the run's plan.
    present: `[K + 1]` bool, whether each share has tokens in the batch.
    merge_aux: `(aux, aux) -> aux` over the parts (None: leafwise sums).

  Returns:
    `(grads, new_state, aux merged over the parts)`.
  """
  merge_aux = merge_aux or functools.partial(jax.tree.map, jnp.add)

  def share_grads(share):
    def part_loss(params, i):
      shares, aux = part_shares_fn(params, i)
      return shares[share], aux

    def part_grads(i):
      return jax.grad(part_loss, has_aux=True)(params, i)

    def add_part(carry, i):
      grads, aux = part_grads(i)
      return (jax.tree.map(jnp.add, carry[0], grads),
              merge_aux(carry[1], aux)), None

    (grads, aux), _ = jax.lax.scan(
        add_part, part_grads(jnp.int32(0)),
        jnp.arange(1, num_parts, dtype=jnp.int32))
    return grads, aux

  return balance_shares(share_grads, params, state, plan, present)
