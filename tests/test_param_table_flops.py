"""`param_table --flops`: XLA's forward FLOPs against a hand count of the
T5.1.1 matmuls, and how the count behaves with batch and variant."""

import contextlib
import dataclasses
import io
import json

import pytest

from conftest import T5X_TINY_CONFIG
from hyperprompt_jax import hyperprompt
from hyperprompt_jax import network
from hyperprompt_jax import param_table


def _matmul_flops(cfg: network.T5Config, inputs: int, targets: int) -> int:
  """2 * m * n * k for every matrix product of one example's teacher-forced
  forward: one-hot embedding lookups, Q / K / V / O projections, attention
  logits and weighted values, gated-GELU FFN (wi_0, wi_1, wo), logits."""
  d, v, f = cfg.emb_dim, cfg.vocab_size, cfg.mlp_dim
  j = cfg.num_heads * cfg.head_dim
  ffn = lambda n: 3 * 2 * n * d * f
  attention = lambda nq, nk: (2 * 2 * nq * d * j + 2 * 2 * nk * d * j
                              + 2 * 2 * nq * nk * j)
  encoder = 2 * inputs * v * d + cfg.num_encoder_layers * (
      attention(inputs, inputs) + ffn(inputs))
  decoder = 2 * targets * v * d + cfg.num_decoder_layers * (
      attention(targets, targets) + attention(targets, inputs)
      + ffn(targets)) + 2 * targets * d * v
  return encoder + decoder


@pytest.mark.parametrize('inputs, targets', [(64, 16), (128, 8)])
def test_mtl_flops_are_the_matmuls_plus_a_little(inputs, targets):
  cfg = T5X_TINY_CONFIG
  got = param_table.forward_flops(network.Transformer(cfg), inputs, targets)
  want = _matmul_flops(cfg, inputs, targets)
  # Softmax, norms, GELU and masks add elementwise work on top of the
  # matmuls: measured 3-8% at these tiny widths (d = 32).
  assert want <= got <= 1.12 * want


def test_batch_spreads_the_per_task_cost():
  mtl = network.Transformer(T5X_TINY_CONFIG)
  one = param_table.forward_flops(mtl, 32, 8, batch_size=1)
  four = param_table.forward_flops(mtl, 32, 8, batch_size=4)
  assert four == pytest.approx(one, rel=0.01)
  # Hyper-prompts are generated once per forward for all T tasks: their
  # share per example falls with the batch.
  hp = network.Transformer(dataclasses.replace(
      T5X_TINY_CONFIG, hyperprompt=hyperprompt.HyperPromptConfig(
          hypernet_reduction=8)))
  hp_one = param_table.forward_flops(hp, 32, 8, batch_size=1)
  hp_four = param_table.forward_flops(hp, 32, 8, batch_size=4)
  assert hp_four < hp_one and hp_one > one


def test_flops_flag_in_json_and_table():
  argv = ['--gin_file=models/t5_1_1_tiny.gin', '--flops', '--input_length=16',
          '--target_length=4', '--batch_size=2']
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table.main(argv + ['--json']) == 0
  summary = json.loads(out.getvalue())
  assert summary['forward_flops_per_example'] > 0
  assert (summary['flops_input_length'], summary['flops_target_length'],
          summary['flops_batch_size']) == (16, 4, 2)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table.main(argv) == 0
  assert 'forward FLOPs / example (input 16, target 4, batch 2)' in (
      out.getvalue())
  plain = io.StringIO()
  with contextlib.redirect_stdout(plain):
    param_table.main(['--gin_file=models/t5_1_1_tiny.gin', '--json'])
  assert 'forward_flops_per_example' not in json.loads(plain.getvalue())


def test_bad_length_is_a_usage_error(capsys):
  with pytest.raises(SystemExit):
    param_table.main(['--gin_file=models/t5_1_1_tiny.gin', '--flops',
                      '--input_length=0'])
  assert '--input_length must be a positive integer' in capsys.readouterr().err
