"""What the commands that read checkpoints share (eval, infer, probe,
leaderboard): `CheckpointJob`, a gin dataclass in the manner of t5x's
`utils.DatasetConfig`, and their first steps."""

import argparse
import dataclasses
import logging
from typing import Mapping, Optional, Sequence, Union

import gin
import jax

from hyperprompt_jax import paths
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import multihost
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.evaluation import run_config
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import task_ids


@dataclasses.dataclass(frozen=True)
class CheckpointJob:
  """One command's checkpoints, data, output and mesh.

  gin: `checkpoint_job.CheckpointJob`, bound in
  gin/runs/{eval,infer,probe,leaderboard}.gin with t5x's macro names.

  Attributes:
    checkpoint_path: a `checkpoint_<step>` folder, a folder of them, or (eval
      only) a list of such folders, runs of one setup (CHECKPOINT_PATH).
    output_dir: where the command's files go (EVAL_OUTPUT_DIR,
      INFER_OUTPUT_DIR, PROBE_OUTPUT_DIR, LEADERBOARD_OUTPUT_DIR).
    mixture_or_task_name: a registered seqio Task / Mixture.
    task_feature_lengths: {'inputs': L_in, 'targets': L_out}; the targets'
      length is the most tokens decoded.
    split: the split every task is read from.
    batch_size: examples per device call, over all processes.
    mesh_data, mesh_model: the device mesh (-1: the remaining devices;
      mesh_model None: the run's MESH_MODEL, from its config.gin, else 1).
  """
  checkpoint_path: Union[str, Sequence[str]]
  output_dir: str
  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  split: str = 'validation'
  batch_size: int = 64
  mesh_data: int = -1
  mesh_model: Optional[int] = None

  def mesh(self) -> jax.sharding.Mesh:
    """The job's ('data', 'model') device mesh."""
    return partitioning.create_mesh(self.mesh_data, self.model_parallelism())

  def model_parallelism(self) -> int:
    """MESH_MODEL: the one given, else the run's (its config.gin), else 1."""
    if self.mesh_model is not None:
      return self.mesh_model
    first = (self.checkpoint_path if isinstance(self.checkpoint_path, str)
             else self.checkpoint_path[0])
    recorded = run_config.recorded_mesh_model(first)
    if recorded is not None:
      logging.getLogger('hyperprompt_jax').info(
          'MESH_MODEL=%d, as the run records (%s).', recorded,
          run_config.run_dir(first))
    return recorded or 1


def checked_model(model: Optional[network.Transformer], job: CheckpointJob,
                  output_macro: str) -> network.Transformer:
  """The network to run, once the job is checked to be able to start.

  Args:
    model: the network; None builds `network.Transformer` from gin.
    job: the job.
    output_macro: the output directory's macro, for the message.

  Returns:
    The network.

  Raises:
    ValueError: on every process alike, for an output directory that is
      not writable or a task-id space other than the run's task list's.
  """
  model = model or gin.get_configurable(network.Transformer)()
  multihost.raise_everywhere(
      lambda: paths.check_writable_dir(job.output_dir, output_macro),
      ValueError)
  task_ids.check_num_tasks(model.config.num_tasks)
  return model


def configure(args: argparse.Namespace, log: logging.Logger) -> None:
  """Logs to stdout, parses the gin flags and joins the processes."""
  gin_utils.log_to_stdout(log)
  gin_utils.parse_gin_flags(args)
  multihost.initialize_from_flags(args)
