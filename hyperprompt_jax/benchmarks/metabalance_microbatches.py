"""MetaBalance with microbatches, the two loop orders side by side: XLA's
peak-memory estimate and one step's seconds of the gradient.

`python -m hyperprompt_jax.benchmarks.metabalance_microbatches` (a
4-layer T5, d_model 256, 8 tasks: K = 7, batch 16 of 128 / 16 tokens; a
few minutes on CPU). Shares outer is `metabalance.balanced_gradient_in_parts`
(what both runners take); parts outer, kept here only to measure against,
takes every part's K + 1 backward passes in turn into K + 1 accumulators,
then balances them. The plain gradient (1 and 2 parts) for scale.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax import task_params
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.model import network
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import trainer


def main() -> None:
  """Prints one row per (loop order, parts)."""
  T = 8
  cfg = network.T5Config(vocab_size=4096, emb_dim=256, num_heads=4, head_dim=64,
                         mlp_dim=1024, num_encoder_layers=2,
                         num_decoder_layers=2, dropout_rate=0.0, num_tasks=T)
  model = network.Transformer(cfg)
  B, LI, LT = 16, 128, 16
  batch = timing.random_batch(np.random.default_rng(0), B, LI, LT,
                              cfg.vocab_size, T)
  batch['task_ids'] = np.arange(B, dtype=np.int32) % T
  names = tuple(f't{i}' for i in range(T))
  plan = metabalance.make_plan(metabalance.Settings(target_task='t0'), names,
                               names, task_params.task_axes(model))
  params = jax.eval_shape(lambda: network.init_variables(
      model, jax.random.PRNGKey(0), LI, LT)['params'])
  state = metabalance.shared_state_shapes(plan, params)
  rng = jax.random.PRNGKey(0)


  def parts_outer(params, state, batch, n):
    weights = batch['decoder_loss_weights'].astype(jnp.float32)
    tokens = jnp.maximum(weights.sum(), 1.0)
    in_group = metabalance.group_masks(plan, trainer.target_task_ids(batch), T)
    present = jnp.einsum('bl,blg->g', weights, in_group) > 0
    parts = trainer.microbatches(batch, n)
    k1 = plan.num_auxiliary + 1

    def add_part(acc, i):
      part = jax.tree.map(lambda x: x[i], parts)
      shares, vjp_fn = jax.vjp(lambda p: trainer._loss_shares(
          model, p, part, jax.random.fold_in(rng, i), None, 1e-4, plan,
          tokens)[0], params)

      def add_share(acc, s):
        (g,) = vjp_fn(jax.nn.one_hot(s, k1))
        return jax.tree.map(lambda a, g: a.at[s].add(g), acc, g), None
      return jax.lax.scan(add_share, acc, jnp.arange(k1))[0], None

    acc = jax.tree.map(lambda p: jnp.zeros((k1,) + p.shape, p.dtype), params)
    acc, _ = jax.lax.scan(add_part, acc, jnp.arange(n))
    return metabalance.balance_shares(
        lambda s: (jax.tree.map(lambda a: a[s], acc), ()), params, state,
        plan, present)[:2]


  def shares_outer(params, state, batch, n):
    return trainer.balanced_grads(model, params, state, batch, rng, 1e-4, None,
                                  plan, n)[:2]


  def plain(params, state, batch, n):
    return jax.grad(lambda p: trainer.loss_fn(model, p, batch, rng, 1e-4)[0])(
        params)


  real = jax.jit(lambda: network.init_variables(model, jax.random.PRNGKey(0),
                                                LI, LT)['params'])()
  real_state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state)
  print(f'K = {plan.num_auxiliary}, batch {B} of {LI} / {LT}, '
        f'params {sum(x.size for x in jax.tree.leaves(params)) * 4 / 2**20:.1f} MiB')
  for name, fn, ns in [('plain', plain, (1, 2)), ('shares outer', shares_outer, (1, 2, 4)),
                       ('parts outer', parts_outer, (2, 4))]:
    for n in ns:
      if name == 'plain' and n > 1:
        fn2 = lambda p, s, b, n: trainer.microbatched_grads(model, p, b, rng, 1e-4, None, n)[1]
      else:
        fn2 = fn
      step = jax.jit(functools.partial(fn2, n=n)).lower(real, real_state, batch).compile()
      peak = timing.peak_bytes(step)
      jax.block_until_ready(step(real, real_state, batch))
      t = time.perf_counter(); jax.block_until_ready(step(real, real_state, batch)); t = time.perf_counter() - t
      print(f'{name:<13} n={n}  peak {peak / 2**20:8.1f} MiB  {t:6.2f} s', flush=True)


if __name__ == '__main__':
  main()
