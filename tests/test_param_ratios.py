"""#Params of the HyperPrompt variants against the paper (Tables 3-5, 9-11)
and its parameter formula (Appendix A.1)."""

import contextlib
import io
import json

import pytest

from hyperprompt_jax import param_table


def _summary(model, variant, placement):
  argv = [f'--gin_file=models/{model}.gin',
          f'--gin_file=variants/hyperprompt_{variant}.gin',
          f"--gin.PLACEMENT='{placement}'", '--json']
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table.main(argv) == 0
  return json.loads(out.getvalue())


# (model, variant, placement) -> the paper's printed #Params and its decimals.
PAPER = [
    ('t5_1_1_base', 'share', 'both', '1.008'),
    ('t5_1_1_base', 'sep', 'both', '1.06'),
    ('t5_1_1_base', 'global', 'both', '1.04'),
    ('t5_1_1_base', 'share', 'decoder', '1.004'),
    ('t5_1_1_base', 'sep', 'decoder', '1.03'),
    ('t5_1_1_base', 'global', 'decoder', '1.02'),
    ('t5_1_1_base', 'global', 'encoder', '1.02'),
    ('t5_1_1_large', 'global', 'decoder', '1.01'),
]


@pytest.mark.parametrize('model, variant, placement, printed', PAPER)
def test_ratio_rounds_to_the_papers_params(model, variant, placement, printed):
  ratio = _summary(model, variant, placement)['ratio']
  decimals = len(printed.split('.')[1])
  assert f'{ratio:.{decimals}f}' == printed


def test_global_count_is_the_papers_formula():
  """Per stack: d l T + 4 b d t + T t' + M t' + (2 t' + t) e (d = h d_h)."""
  d, m, t_ = 768, 12, 8
  b, t1, e, t = d // 32, 64, 128, 64
  per_stack = lambda l: (d * l * t_ + 4 * b * d * t + t_ * t1 + m * t1
                         + (2 * t1 + t) * e)
  both = _summary('t5_1_1_base', 'global', 'both')
  assert both['task_conditioned_parameters'] == per_stack(16) + per_stack(6)
  decoder = _summary('t5_1_1_base', 'global', 'decoder')
  assert decoder['task_conditioned_parameters'] == per_stack(6)


def test_share_and_sep_counts():
  d, m, t_, b = 768, 12, 8, 24
  prompts = d * (16 + 6) * t_
  share = _summary('t5_1_1_base', 'share', 'both')
  assert share['task_conditioned_parameters'] == prompts + 2 * m * 4 * d * b
  sep = _summary('t5_1_1_base', 'sep', 'both')
  assert sep['task_conditioned_parameters'] == prompts + 2 * t_ * m * 4 * d * b


def _baseline_summary(variant, placement=None):
  argv = ['--gin_file=models/t5_1_1_base.gin',
          f'--gin_file=variants/{variant}.gin', '--json']
  if placement:
    argv.append(f"--gin.PLACEMENT='{placement}'")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table.main(argv) == 0
  return json.loads(out.getvalue())


# The baselines' #Params at T5.1.1-base, T = 8 (Tables 3, 5, 9): GLUE runs
# adapt both stacks, SuperGLUE runs the decoder.
BASELINES = [
    ('adapter', 'both', '1.06'),
    ('adapter', 'decoder', '1.03'),
    ('hyperformer_pp', 'both', '1.04'),
    ('hyperformer_pp', 'decoder', '1.02'),
    ('prompt_tuning', None, '1.0003'),
]


@pytest.mark.parametrize('variant, placement, printed', BASELINES)
def test_baseline_ratio_rounds_to_the_papers_params(variant, placement,
                                                    printed):
  ratio = _baseline_summary(variant, placement)['ratio']
  decimals = len(printed.split('.')[1])
  assert f'{ratio:.{decimals}f}' == printed


def test_baseline_counts():
  """Hand counts at d = 768, 12 layers per stack, T = 8."""
  d, m, t_ = 768, 12, 8
  b = d // 32  # Vanilla: 2 adapters per block, down + bias, up + bias
  vanilla = 2 * m * t_ * (d * b + b + b * d + d)
  assert _baseline_summary('adapter')['task_conditioned_parameters'] == (
      2 * vanilla)
  b, te, e, t = d // 16, 512, 128, 64  # HyperFormer++, per stack:
  generators = (t + 1) * (d * b + b * d + b + d + d + d)
  projector = 3 * te * e + e + e * t + t + 2 * t
  embeddings = (t_ + m + 2) * te
  per_stack = generators + projector + embeddings
  assert _baseline_summary('hyperformer_pp', 'decoder')[
      'task_conditioned_parameters'] == per_stack
  assert _baseline_summary('prompt_tuning')[
      'task_conditioned_parameters'] == t_ * 12 * d
