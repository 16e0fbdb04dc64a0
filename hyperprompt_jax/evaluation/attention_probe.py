"""The attention probe (HyperPrompt, Sec. 4.6, Fig. 3).

The attention mass and entropy over the hyper-prompts per layer, per
checkpoint. The command is `python -m hyperprompt_jax.probe`
(docs/evaluation.md, "The attention probe (HyperPrompt Fig. 3)").
"""

import argparse
import json
import logging
import os
from typing import Any, Mapping, Optional, Sequence

from flax import traverse_util
from flax.linen import partitioning as nn_partitioning
import gin
import jax
import jax.numpy as jnp
import numpy as np
import seqio
import tensorflow as tf

from hyperprompt_jax import files
from hyperprompt_jax import task_params
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import multihost
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import inference
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import layers
from hyperprompt_jax.tasks import task_ids

log = logging.getLogger('hyperprompt_jax.probe')

# stack -> the attention module's name in every layer of it.
STACKS = {'encoder': ('encoder', 'attention'),
          'decoder': ('decoder', 'self_attention'),
          'cross': ('decoder', 'encoder_decoder_attention')}
PROBE_FILE = 'probe.json'


def attention_statistics(weights: jax.Array, prompt_columns: int
                         ) -> dict[str, jax.Array]:
  """Per query: mass on the first `prompt_columns` key columns, entropy over
  all, and entropy over the others renormalised.

  Args:
    weights: `[batch, heads, q, k]` attention probabilities.
    prompt_columns: how many leading key columns are prompts (0: none).

  Returns:
    {'prompt_mass', 'entropy', 'token_entropy'}, each `[batch, heads, q]`
    float32 (nats).
  """
  w = weights.astype(jnp.float32)
  mass = w[..., :prompt_columns].sum(-1)
  tokens = w[..., prompt_columns:]
  tokens = tokens / jnp.maximum(tokens.sum(-1, keepdims=True), 1e-30)
  entropy = lambda p: -jax.scipy.special.xlogy(p, p).sum(-1)
  return {'prompt_mass': mass, 'entropy': entropy(w),
          'token_entropy': entropy(tokens)}


def prompt_columns(config: network.T5Config, stack: str, num_keys: int,
                   num_token_keys: int) -> int:
  """How many leading key columns of `stack`'s attention are prompts.

  The hyper-prompt prefix (keys beyond the tokens), and Prompt-Tuning's soft
  positions where the encoder's states are the keys.
  """
  prefix = num_keys - num_token_keys
  if stack in ('encoder', 'cross'):
    prefix += prompt_tuning.prompt_length(config.prompt_tuning)
  return prefix


def has_prompts(config: network.T5Config, stack: str) -> bool:
  """Whether `stack`'s attention has prompt columns to put mass on."""
  if stack in ('encoder', 'cross') and config.prompt_tuning is not None:
    return True
  hp = config.hyperprompt
  return stack != 'cross' and hp is not None and hyperprompt.is_active(
      hp, stack)


def make_probe_step(model: network.Transformer,
                    mesh: Optional[jax.sharding.Mesh] = None):
  """The jitted probe of one batch.

  Args:
    model: the network.
    mesh: places the batch (the same on every process) along 'data'; the
      parameters must be placed by `partitioning.parameter_shardings`, and
      the sums come back as host numpy on every process.

  Returns:
    `(params, batch) -> {stack: {statistic: [layers, tasks, heads] sums},
    'counts': {stack: [tasks] real queries}}`.
  """
  cfg = model.config
  n_prompt = prompt_tuning.prompt_length(cfg.prompt_tuning)
  rules = partitioning.logical_axis_rules()

  def step(params, batch):
    enc = batch['encoder_input_tokens']
    tgt = batch['decoder_target_tokens']
    with nn_partitioning.axis_rules(rules):
      _, state = model.apply(
          {'params': params}, enc, batch['decoder_input_tokens'], tgt,
          task_ids=batch['task_ids'], enable_dropout=False,
          mutable=[layers.PROBE_COLLECTION])
    sown = traverse_util.flatten_dict(state[layers.PROBE_COLLECTION],
                                      sep='/')
    enc_valid = prompt_tuning.extend_valid(cfg.prompt_tuning, enc > 0)
    if n_prompt:  # the soft prompts are not queries of the examples
      enc_valid = enc_valid.at[:, :n_prompt].set(False)
    valid = {'encoder': enc_valid, 'decoder': tgt > 0, 'cross': tgt > 0}
    onehot = jax.nn.one_hot(batch['task_ids'], cfg.num_tasks)
    out = {'counts': {}}
    for stack, (scope, name) in STACKS.items():
      n_layers = (cfg.num_encoder_layers if scope == 'encoder'
                  else cfg.num_decoder_layers)
      per_layer = []
      for i in range(n_layers):
        (weights,) = sown[f'{scope}/layers_{i}/{name}/'
                          f'{layers.ATTENTION_WEIGHTS}']
        token_keys = (enc_valid.shape[1] if stack == 'cross'
                      else weights.shape[2])
        stats = attention_statistics(weights, prompt_columns(
            cfg, stack, weights.shape[3], token_keys))
        q = valid[stack].astype(jnp.float32)
        per_layer.append({k: jnp.einsum('bt,bq,bhq->th', onehot, q, v)
                          for k, v in stats.items()})
      out[stack] = {k: jnp.stack([p[k] for p in per_layer])
                    for k in per_layer[0]}
      out['counts'][stack] = jnp.einsum('bt,bq->t', onehot,
                                        valid[stack].astype(jnp.float32))
    return out

  if mesh is None:
    return jax.jit(step)
  spec = jax.sharding.PartitionSpec
  jitted = jax.jit(step, out_shardings=jax.sharding.NamedSharding(
      mesh, spec()))
  batch_sharding = jax.sharding.NamedSharding(mesh, spec('data'))

  def placed(params, batch):
    batch = jax.device_put(dict(batch), batch_sharding)
    with jax.set_mesh(mesh):
      return multihost.host_value(jitted(params, batch))

  return placed


def task_batches(task: seqio.Task, task_feature_lengths: Mapping[str, int],
                 split: str, num_examples: Optional[int], batch_size: int):
  """`split`'s first examples as feature batches, the last padded empty."""
  _, features = inference.task_examples(task, task_feature_lengths, split,
                                   num_examples)
  for batch in features.padded_batch(batch_size).as_numpy_iterator():
    pad = batch_size - len(batch['task_ids'])
    yield {k: np.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
           for k, v in batch.items()}


def probe_checkpoint(model: network.Transformer, params: Any,
                     tasks: Sequence[seqio.Task],
                     task_feature_lengths: Mapping[str, int], split: str,
                     num_examples: Optional[int], batch_size: int,
                     step_fn=None) -> dict:
  """`{stack: {task: {statistic: [[per head] per layer]}}}`, query means.

  prompt_mass is None where the stack has no prompts.
  """
  step_fn = step_fn or make_probe_step(model)
  totals = None
  for task in tasks:
    for batch in task_batches(task, task_feature_lengths, split,
                              num_examples, batch_size):
      out = jax.device_get(step_fn(params, batch))
      totals = out if totals is None else jax.tree.map(np.add, totals, out)
  result = {}
  names = {task_ids.task_id(t.name): task_ids.canonical_task(t.name)
           for t in tasks}
  for stack in STACKS:
    counts = totals['counts'][stack]
    result[stack] = {}
    for tid, name in sorted(names.items()):
      if counts[tid] == 0:
        continue
      means = {k: (v[:, tid, :] / counts[tid]).tolist()
               for k, v in totals[stack].items()}
      if not has_prompts(model.config, stack):
        means['prompt_mass'] = None
      result[stack][name] = means
  return result


@gin.configurable(denylist=['model'])
def probe(
    model: Optional[network.Transformer] = None,
    *,
    job: checkpoint_job.CheckpointJob = gin.REQUIRED,
    num_examples: Optional[int] = 100,
) -> dict[str, Any]:
  """Probes every checkpoint of `job`; process 0 writes the files.

  Args:
    model: the network; None builds `network.Transformer` from gin.
    job: the checkpoints, data, output directory and mesh.
    num_examples: the first examples of each task's split; None: all.

  Returns:
    The summary written to probe.json (docs/evaluation.md, "The attention
    probe (HyperPrompt Fig. 3)").
  """
  found = checkpoints.find_checkpoints(job.checkpoint_path)
  model = checkpoint_job.checked_model(model, job, 'PROBE_OUTPUT_DIR')
  tasks = input_pipeline.eval_tasks(job.mixture_or_task_name, job.split)
  lengths = job.task_feature_lengths
  variables = network.abstract_variables(model, lengths['inputs'],
                                         lengths['targets'])
  abstract = variables['params']
  mesh = job.mesh()
  if job.batch_size % mesh.shape['data']:
    raise ValueError(f'PROBE_BATCH_SIZE={job.batch_size} does not divide '
                     f"over the mesh's {mesh.shape['data']} data shards.")
  param_shardings = partitioning.parameter_shardings(
      variables['params_axes'], mesh)
  step_fn = make_probe_step(model, mesh)
  cfg = model.config
  summary = {
      'methods': task_params.method_names(model) or ['mtl'],
      'prompt_columns': {
          stack: has_prompts(cfg, stack) for stack in STACKS},
      'split': job.split, 'num_examples': num_examples, 'steps': {}}
  for step, path in found:
    run_record.check_checkpoint(path, cfg, task_ids.run_task_list())
    params, _ = checkpoints.restore_params(path, abstract)
    params = jax.device_put(params, param_shardings)
    summary['steps'][str(step)] = probe_checkpoint(
        model, params, tasks, lengths, job.split, num_examples,
        job.batch_size, step_fn)
    log.info('checkpoint_%d probed.', step)
  if not multihost.is_writer():
    return summary
  tf.io.gfile.makedirs(job.output_dir)
  path = os.path.join(job.output_dir, PROBE_FILE)
  files.write_atomically(path, json.dumps(summary, indent=1))
  written = [path] + [plot(summary, stack, job.output_dir)
                      for stack in STACKS]
  log.info('Wrote %s', ', '.join(written))
  return summary


def plot(summary: Mapping[str, Any], stack: str, output_dir: str) -> str:
  """Plots `probe_<stack>.png`; returns its path.

  Prompt mass (if any) and entropies by layer (mean over heads), a line per
  task, a column per checkpoint.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  steps = sorted(summary['steps'], key=int)
  rows = (['prompt_mass'] if summary['prompt_columns'][stack] else []) + [
      'entropy', 'token_entropy']
  fig, axes = plt.subplots(len(rows), len(steps), squeeze=False,
                           figsize=(3.2 * len(steps) + 2, 2.6 * len(rows)),
                           sharey='row')
  colours = plt.get_cmap('tab20').colors
  for col, step in enumerate(steps):
    by_task = summary['steps'][step][stack]
    for row, stat in enumerate(rows):
      ax = axes[row][col]
      for i, (task, values) in enumerate(sorted(by_task.items())):
        per_layer = np.mean(np.array(values[stat]), axis=1)
        ax.plot(np.arange(1, len(per_layer) + 1), per_layer, marker='o',
                markersize=3, linewidth=1, color=colours[i % len(colours)],
                label=task)
      ax.grid(alpha=0.3)
      ax.set_xticks(np.arange(1, len(per_layer) + 1))
      if row == 0:
        ax.set_title(f'step {step}', fontsize=9)
      if col == 0:
        ax.set_ylabel(stat.replace('_', ' '), fontsize=9)
      if row == len(rows) - 1:
        ax.set_xlabel(f'{stack} layer', fontsize=9)
  axes[0][-1].legend(fontsize=6, loc='center left', bbox_to_anchor=(1, 0.5))
  fig.tight_layout()
  path = os.path.join(output_dir, f'probe_{stack}.png')
  with tf.io.gfile.GFile(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=100)
  plt.close(fig)
  return path


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.probe` with its parsed flags."""
  checkpoint_job.configure(args, log)
  probe()
  return 0

