"""The task-separation problem: identical inputs, answers set by the task id.

Every task reads the same distribution of inputs (`length` random words and
EOS, no task prefix); task k answers with the input's k-th word. Only the
task id tells the tasks apart, so a model that ignores it is at chance
(1 / num_tasks exact match) and a model that uses it can reach 1.0. Shared
by `test_task_separation.py` and the measurement behind the README's table.
"""

from typing import Any, Sequence

from flax import traverse_util
import gin
import jax
import numpy as np
import optax

from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import losses

EOS = 1
FIRST_WORD = 2  # 0 is padding, 1 is EOS

# gin/variants files, 'mtl' for none.
VARIANTS = ('mtl', 'adapter', 'hyperformer_pp', 'prompt_tuning',
            'hyperprompt_share', 'hyperprompt_sep', 'hyperprompt_global',
            'hypergrid_l', 'hypergrid_l2', 'hypergrid_lg', 'hypergrid_gl',
            'output_gating')


def make_batches(seed: int, steps: int, batch_size: int, num_tasks: int,
                 length: int, words: int, named: bool = False
                 ) -> dict[str, np.ndarray]:
  """`steps` batches of the problem, stacked: `[steps, batch, ...]`.

  Inputs `[steps, batch, length + 2]`: a name slot, `length` words, EOS. The
  slot holds one token for every task, or with `named` the task's own token
  (as T5's text prefixes name the task: the MTL backbone of the "Task"
  setting learns the tasks that way). Targets `[steps, batch, 2]` (the
  task's word, EOS); task ids `[steps, batch]`.
  """
  rng = np.random.default_rng(seed)
  words_ = rng.integers(FIRST_WORD, FIRST_WORD + words,
                        (steps, batch_size, length), dtype=np.int32)
  task_ids = rng.integers(0, num_tasks, (steps, batch_size), dtype=np.int32)
  answer = np.take_along_axis(words_, task_ids[..., None], -1)
  name_ids = task_ids if named else np.full_like(task_ids, num_tasks)
  name = (FIRST_WORD + words + name_ids)[..., None]
  eos = np.full_like(answer, EOS)
  targets = np.concatenate([answer, eos], -1)
  return {
      'encoder_input_tokens': np.concatenate([name, words_, eos], -1),
      'decoder_input_tokens': np.concatenate([np.zeros_like(answer), answer],
                                             -1),
      'decoder_target_tokens': targets,
      'decoder_loss_weights': np.ones_like(targets),
      'task_ids': task_ids,
  }


def build_config(variant: str, model_file: str,
                 bindings: Sequence[str] = ()) -> network.T5Config:
  """The `T5Config` of `model_file` + `variants/<variant>.gin` + bindings."""
  gin.clear_config()
  files = [model_file] + ([] if variant == 'mtl' else
                          [f'variants/{variant}.gin'])
  try:
    gin_utils.parse_gin(files, bindings)
    return gin.get_configurable(network.Transformer)().config
  finally:
    gin.clear_config()


def init_params(model: network.Transformer, seed: int = 0) -> Any:
  # Eager: its one-op programs are compiled once and shared by every variant
  # a process builds; a jitted init would compile a program per variant.
  return network.init_variables(model, jax.random.PRNGKey(seed))['params']


def train(model: network.Transformer, optimizer: optax.GradientTransformation,
          params: Any, batches: dict[str, np.ndarray],
          z_loss: float = 1e-4) -> tuple[Any, np.ndarray]:
  """Runs one optimizer step per stacked batch (one compiled `lax.scan`).

  Returns:
    `(params, losses [steps])`.
  """

  def loss_fn(p, batch):
    logits = model.apply({'params': p}, batch['encoder_input_tokens'],
                         batch['decoder_input_tokens'],
                         batch['decoder_target_tokens'], enable_dropout=False,
                         task_ids=batch['task_ids'])
    return losses.cross_entropy_with_z_loss(
        logits, batch['decoder_target_tokens'],
        batch['decoder_loss_weights'], z_loss)['loss']

  def step(carry, batch):
    p, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    return (optax.apply_updates(p, updates), opt_state), loss

  @jax.jit
  def run(p, batches):
    (p, _), losses_ = jax.lax.scan(step, (p, optimizer.init(p)), batches)
    return p, losses_

  params, losses_ = run(params, batches)
  return params, np.asarray(losses_)


def exact_match(model: network.Transformer, params: Any,
                batch: dict[str, np.ndarray], num_tasks: int) -> np.ndarray:
  """Greedy exact match per task, `[num_tasks]`.

  The answer is one word and EOS, so greedy decoding gets it right exactly
  when the teacher-forced argmax is right at both positions. Eager, as
  `init_params`.
  """
  logits = np.asarray(model.apply(
      {'params': params}, batch['encoder_input_tokens'],
      batch['decoder_input_tokens'], batch['decoder_target_tokens'],
      enable_dropout=False, task_ids=batch['task_ids']))
  hit = np.all(np.argmax(logits, -1) == batch['decoder_target_tokens'], -1)
  return np.array([hit[batch['task_ids'] == k].mean()
                   for k in range(num_tasks)])


def with_backbone(params: Any, backbone: Any) -> Any:
  """`params` with every backbone leaf replaced by `backbone`'s (same
  paths): task-conditioned parameters stay as initialised."""
  source = traverse_util.flatten_dict(backbone)
  return traverse_util.unflatten_dict({
      path: value if param_groups.is_task_conditioned(path) else source[path]
      for path, value in traverse_util.flatten_dict(params).items()})


def main() -> None:
  """The README's table (Optimizer): every variant, three settings.

      python tests/task_separation.py [--variants=mtl,adapter,...]

  Quickstart dimensions, 4 tasks, 8 words of 64, batch 32; about 15 minutes
  on 2 CPU cores for all variants.
  """
  import argparse  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.training import optimizers  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--all_steps', type=int, default=2500)
  parser.add_argument('--task_steps', type=int, default=1000)
  parser.add_argument('--backbone_steps', type=int, default=1500)
  args = parser.parse_args()
  num_tasks, length, words, batch_size = 4, 8, 64, 32
  bindings = ['network.T5Config.emb_dim = 64',
              'network.T5Config.num_heads = 4',
              'network.T5Config.head_dim = 16',
              'network.T5Config.mlp_dim = 128',
              f'network.T5Config.num_tasks = {num_tasks}',
              'DROPOUT_RATE = 0.0']

  def model(variant):
    return network.Transformer(
        build_config(variant, 'models/t5_1_1_tiny.gin', bindings))

  def data(seed, steps, named=False):
    return make_batches(seed, steps, batch_size, num_tasks, length, words,
                        named=named)

  evaluation = {k: v[0] for k, v in make_batches(
      1000, 1, 1024, num_tasks, length, words).items()}
  mtl = model('mtl')
  backbone, _ = train(mtl, optimizers.make_optimizer(learning_rate=1e-2),
                      init_params(mtl),
                      data(7, args.backbone_steps, named=True))
  print('| model | optimizer | All, scratch, 1e-2 | Task, 1e-2 | Task, 1e-3 |')
  print('| --- | --- | --- | --- | --- |')
  for variant in args.variants.split(','):
    settings = {'default': {}}
    if variant == 'adapter':
      settings["T5's relative steps"] = {'multiply_by_parameter_scale': True}
    net = model(variant)
    for name, kwargs in settings.items():
      params, _ = train(
          net, optimizers.make_optimizer(learning_rate=1e-2, **kwargs),
          init_params(net), data(0, args.all_steps))
      row = [exact_match(net, params, evaluation, num_tasks).mean()]
      for rate in ((1e-2, 1e-3) if variant != 'mtl' else ()):
        params, _ = train(
            net, optimizers.make_optimizer(
                learning_rate=rate, train_only_task_conditioned=True,
                **kwargs),
            with_backbone(init_params(net), backbone),
            data(0, args.task_steps))
        row.append(exact_match(net, params, evaluation, num_tasks).mean())
      cells = [f'{x:.2f}' for x in row] + ['–'] * (3 - len(row))
      print(f'| {variant} | {name} | ' + ' | '.join(cells) + ' |', flush=True)


if __name__ == '__main__':
  main()
