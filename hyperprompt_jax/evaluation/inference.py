"""Predictions of one checkpoint, one JSON-lines file per task.

The command is `python -m hyperprompt_jax.infer` (docs/evaluation.md).
"""

import argparse
import json
import logging
import os
import re
from typing import Any, Mapping, Optional

import gin
import seqio
import tensorflow as tf

from hyperprompt_jax import files
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import multihost
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import feature_converter
from hyperprompt_jax.tasks import task_ids

log = logging.getLogger('hyperprompt_jax.infer')


def _text(value) -> str:
  """`value` as text (bytes decoded)."""
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _step_of(checkpoint_path: str) -> int:
  """The step of an existing `checkpoint_<step>` folder."""
  match = re.match(r'^checkpoint_(\d+)$',
                   os.path.basename(checkpoint_path.rstrip('/')))
  if not match:
    raise ValueError(f'CHECKPOINT_PATH {checkpoint_path!r} is not a '
                     'checkpoint_<step> folder; infer reads one checkpoint.')
  if not tf.io.gfile.isdir(checkpoint_path):
    raise FileNotFoundError(f'CHECKPOINT_PATH {checkpoint_path!r} does not '
                            'exist.')
  return int(match[1])


def task_examples(task: seqio.Task, task_feature_lengths: Mapping[str, int],
                  split: str, num_examples: Optional[int] = None):
  """`(examples, features)`: `split`'s first examples, and as model features.

  The features are unpacked and unbatched; None `num_examples`: all.
  """
  lengths = dict(task_feature_lengths)
  examples = task.get_dataset(lengths, split=split, shuffle=False,
                              num_epochs=1)
  if num_examples is not None:
    examples = examples.take(num_examples)
  converter = feature_converter.TaskIdsEncDecFeatureConverter(pack=False)
  return examples, converter(examples, lengths)


def task_predictions(task: seqio.Task, predictor: predictor_lib.Predictor,
                     task_feature_lengths: Mapping[str, int], split: str,
                     num_examples: Optional[int] = None) -> list[dict]:
  """Decodes `task`'s `split`.

  Args:
    task: the seqio task.
    predictor: holds the checkpoint's parameters.
    task_feature_lengths: `{'inputs': length, 'targets': length}`.
    split: the split.
    num_examples: the first examples to decode; None: all.

  Returns:
    One record per example: its inputs, targets, prediction, their
    postprocessed values, task id and TFDS `idx`.
  """
  examples, features = task_examples(task, task_feature_lengths, split,
                                     num_examples)
  # The model features and the raw examples come from the same deterministic
  # pipeline, in the same order; raw examples are read one by one (their
  # fields have ragged lengths).
  raw_examples = examples.as_numpy_iterator()
  batches = features.batch(predictor.batch_size)
  vocabulary = task.output_features['targets'].vocabulary
  records = []
  for features in batches.as_numpy_iterator():
    for output in predictor.predict(features):
      example = next(raw_examples)
      prediction = vocabulary.decode(output.tolist())
      target = _text(example['targets_pretokenized'])
      records.append({
          'inputs': _text(example['inputs_pretokenized']),
          'targets': target,
          'prediction': prediction,
          'prediction_value': task.postprocess_fn(
              prediction, example=example, is_target=False),
          'target_value': task.postprocess_fn(
              target, example=example, is_target=True),
          'task_id': int(example['task_ids']),
          'idx': example_idx(example),
      })
  return records


def example_idx(example: Mapping[str, Any]) -> Any:
  """The example's TFDS id: `idx`, a dict of `idx/<part>`s, or None."""
  if 'idx' in example:
    return int(example['idx'])
  parts = {k[len('idx/'):]: int(v) for k, v in example.items()
           if k.startswith('idx/')}
  return parts or None


def checkpoint_predictor(model: network.Transformer,
                         job: checkpoint_job.CheckpointJob
                         ) -> predictor_lib.Predictor:
  """A predictor holding the job's checkpoint, its run record checked."""
  predictor, abstract_params = predictor_lib.make_predictor(
      model, job.task_feature_lengths, job.mesh(), job.batch_size)
  run_record.check_checkpoint(job.checkpoint_path, model.config,
                              task_ids.run_task_list())
  predictor.set_params(
      checkpoints.restore_params(job.checkpoint_path, abstract_params)[0])
  return predictor


@gin.configurable(denylist=['model'])
def infer(
    model: Optional[network.Transformer] = None,
    *,
    job: checkpoint_job.CheckpointJob = gin.REQUIRED,
    num_examples: Optional[int] = None,
) -> dict[str, str]:
  """Writes each task's predictions of `job`'s checkpoint.

  Every process decodes its rows of each batch; process 0 writes the files.

  Args:
    model: the network; None builds `network.Transformer` from gin.
    job: the checkpoint, data, output directory and mesh.
    num_examples: the first examples of each task's split; None: all.

  Returns:
    `{task: its file}`.
  """
  step = _step_of(job.checkpoint_path)
  model = checkpoint_job.checked_model(model, job, 'INFER_OUTPUT_DIR')
  provider = input_pipeline.get_mixture_or_task(job.mixture_or_task_name)
  tasks = [t for t in seqio.get_subtasks(provider) if job.split in t.splits]
  if not tasks:
    raise ValueError(f'{job.mixture_or_task_name!r} has no task with a '
                     f'{job.split!r} split.')
  predictor = checkpoint_predictor(model, job)
  written = {}
  for task in tasks:
    records = task_predictions(task, predictor, job.task_feature_lengths,
                               job.split, num_examples)
    path = os.path.join(job.output_dir, f'{task.name}-{step}.jsonl')
    written[task.name] = path
    if not multihost.is_writer():
      continue
    files.write_atomically(path, ''.join(
        json.dumps(record, cls=seqio.loggers.TensorAndNumpyEncoder) + '\n'
        for record in records))
    log.info('%s: %d predictions -> %s', task.name, len(records), path)
  return written


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.infer` with its parsed flags."""
  checkpoint_job.configure(args, log)
  infer()
  return 0
