r"""Parameter table of a gin-configured network, without allocating it.

    python -m hyperprompt_jax.param_table \
        --gin_file=models/t5_1_1_base.gin [--gin_file=variants/...gin] \
        [--gin_file=tasks/glue_super_glue.gin] [--json] \
        [--flops [--input_length=512] [--target_length=32] [--batch_size=1]]

Shapes come from `jax.eval_shape` of the network's `init`, so XXL costs
nothing. Task-conditioned parameters are those under a scope listed in
`hyperprompt_jax.param_groups.TASK_CONDITIONED_SCOPES`; the ratio is
total / backbone, as the papers' "#Params" column. T, the task-id space, is
the task file's `NUM_TASKS` (8 without one; `tasks/glue_super_glue.gin` gives
HyperGrid's 16).

`--flops` adds the forward FLOPs of one example (teacher-forced, at the given
feature lengths) from XLA's cost analysis of the lowered forward pass, again
on abstract shapes. The task-conditioned modules compute their per-task
parts (hyper-prompts, generated adapters) once per forward for all T tasks,
so the count is taken over `--batch_size` examples and divided: at batch 1
that one-off cost lands on one example, at the papers' batch of 128 it is
spread as in training.
"""

import argparse
import collections
import json
import re
from typing import Any, Optional, Sequence

from hyperprompt_jax import gin_utils

_PROG = 'python -m hyperprompt_jax.param_table'


def _positive(flag: str):
  def parse(value: str) -> int:
    if not value.lstrip('-').isdigit() or int(value) <= 0:
      raise argparse.ArgumentTypeError(
          f'--{flag} must be a positive integer, got {value!r}')
    return int(value)
  return parse


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--json', action='store_true',
                      help='print one JSON object instead of the table')
  parser.add_argument('--flops', action='store_true',
                      help='add the forward FLOPs of one example (XLA cost '
                      'analysis of the teacher-forced forward)')
  for flag, default, help_ in (
      ('input_length', 512, 'encoder tokens per example'),
      ('target_length', 32, 'decoder tokens per example'),
      ('batch_size', 1, 'examples per forward: the per-task work of '
       'task-conditioned modules is done once per forward and shared by '
       'the batch (the papers train at 128)')):
    parser.add_argument(f'--{flag}', type=_positive(flag), default=default,
                        help=f'with --flops: {help_} (default {default})')


# Before the heavy imports: --help needs none of them.
gin_utils.cli_preamble(__name__, _PROG, __doc__, _add_flags)

# pylint: disable=g-import-not-at-top,g-bad-import-order
from flax import traverse_util
import gin
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax import network
from hyperprompt_jax import param_groups
# pylint: enable=g-import-not-at-top,g-bad-import-order


def abstract_params(model: network.Transformer) -> dict[str, Any]:
  """'/'-joined path -> `jax.ShapeDtypeStruct` of every parameter."""
  variables = network.abstract_variables(model)
  return traverse_util.flatten_dict(variables['params'], sep='/')


def forward_flops(model: network.Transformer, input_length: int,
                  target_length: int, batch_size: int = 1) -> float:
  """Forward FLOPs per example, from XLA's cost analysis.

  Lowers the teacher-forced forward `model.apply(...)` on abstract shapes (no
  parameter or activation is allocated) and reads `flops` from the HLO cost
  analysis of the lowered, not compiled, program: the computation as written,
  a multiply-add counted as 2 FLOPs (a `[m, k] x [k, n]` matmul is `2 m k n`),
  elementwise ops 1 per element, transcendentals (exp, tanh) apart.

  Args:
    model: the network; its parameters' shapes come from `abstract_params`.
    input_length: encoder tokens per example (`[batch_size, input_length]`).
    target_length: decoder tokens per example (`[batch_size,
      target_length]`).
    batch_size: examples per forward. Task-conditioned modules compute their
      per-task parts (hyper-prompts, generated adapters) once per forward for
      all T tasks: at 1 that one-off cost is charged to one example, a
      training batch (the papers': 128) spreads it.

  Returns:
    The forward's FLOPs divided by `batch_size`.
  """
  params = traverse_util.unflatten_dict(abstract_params(model), sep='/')
  inputs = jax.ShapeDtypeStruct((batch_size, input_length), jnp.int32)
  targets = jax.ShapeDtypeStruct((batch_size, target_length), jnp.int32)
  task_ids = jax.ShapeDtypeStruct((batch_size,), jnp.int32)

  def forward(params, inputs, targets, task_ids):
    return model.apply({'params': params}, inputs, targets, targets,
                       enable_dropout=False, task_ids=task_ids)

  lowered = jax.jit(forward).lower(params, inputs, targets, task_ids)
  # The lowered analysis costs milliseconds (compiling base takes seconds);
  # jax returns None where a backend cannot analyse before compiling.
  analysis = lowered.cost_analysis()
  if not analysis:
    analysis = lowered.compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per device
    analysis = analysis[0]
  return float(analysis['flops']) / batch_size


def summarize(params: dict[str, Any]) -> dict[str, Any]:
  """The `--json` object: totals, task-conditioned part, ratio, shapes."""
  sizes = {k: int(np.prod(v.shape)) for k, v in params.items()}
  total = sum(sizes.values())
  task = sum(n for k, n in sizes.items() if param_groups.is_task_conditioned(k))
  backbone = total - task
  return {
      'total_parameters': total,
      'backbone_parameters': backbone,
      'task_conditioned_parameters': task,
      'ratio': total / backbone if backbone else float('inf'),
      'parameters': {k: list(v.shape) for k, v in sorted(params.items())},
  }


def _module_of(path: str) -> str:
  """Groups per-layer parameters: 'encoder/layers_3/mlp/wo/kernel' ->
  'encoder/layers_*/mlp'."""
  parts = re.sub(r'layers_\d+', 'layers_*', path).split('/')[:-1]
  keep = 3 if len(parts) > 1 and parts[1] == 'layers_*' else 2
  return '/'.join(parts[:keep])


def format_table(summary: dict[str, Any]) -> str:
  by_module = collections.Counter()
  for path, shape in summary['parameters'].items():
    by_module[_module_of(path)] += int(np.prod(shape))
  width = max(len(m) for m in by_module) + 2
  lines = [f'{"module":<{width}}{"parameters":>16}  kind']
  for module, n in sorted(by_module.items()):
    kind = ('task-conditioned' if param_groups.is_task_conditioned(module)
            else 'backbone')
    lines.append(f'{module:<{width}}{n:>16,}  {kind}')
  lines += [
      '',
      f'{"total":<{width}}{summary["total_parameters"]:>16,}',
      f'{"backbone":<{width}}{summary["backbone_parameters"]:>16,}',
      f'{"task-conditioned":<{width}}'
      f'{summary["task_conditioned_parameters"]:>16,}',
      f'{"ratio total/backbone":<{width}}{summary["ratio"]:>16.4f}x',
  ]
  if 'forward_flops_per_example' in summary:
    lines.append(
        f'forward FLOPs / example (input {summary["flops_input_length"]}, '
        f'target {summary["flops_target_length"]}, batch '
        f'{summary["flops_batch_size"]}): '
        f'{summary["forward_flops_per_example"]:.3e}')
  return '\n'.join(lines)


def build_network() -> network.Transformer:
  """The network the parsed gin configuration describes."""
  return gin.get_configurable(network.Transformer)()


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.parse_command_line(_PROG, __doc__, argv,
                                      add_flags=_add_flags)
  model = build_network()
  summary = summarize(abstract_params(model))
  if args.flops:
    summary.update(
        forward_flops_per_example=forward_flops(
            model, args.input_length, args.target_length, args.batch_size),
        flops_input_length=args.input_length,
        flops_target_length=args.target_length,
        flops_batch_size=args.batch_size)
  print(json.dumps(summary) if args.json else format_table(summary))
  return 0


if __name__ == '__main__':
  gin_utils.run(main)
