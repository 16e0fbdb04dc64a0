"""Parameter tables (total, backbone, task-conditioned, per scope) and
forward FLOPs of a gin-configured model, from abstract shapes. Its command:
`python -m hyperprompt_jax.param_table`."""

import argparse
import collections
import json
import re
from typing import Any

from flax import traverse_util
import gin
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network


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


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.param_table` with its parsed flags."""
  gin_utils.parse_gin_flags(args)
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

