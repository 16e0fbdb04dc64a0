"""`param_table --flops`: XLA's forward FLOPs against a hand count of the
T5.1.1 matmuls, and how the count moves with input length, batch and variant.

Everything runs on `models/t5_1_1_tiny.gin` (d = 32, 4 heads x 8, gated-GELU
FFN 64, vocab 384, 2 + 2 layers): one count lowers in well under a second.
"""

import contextlib
import io
import json

import pytest

from hyperprompt_jax import param_table as param_table_command
from hyperprompt_jax.benchmarks import param_counts
from hyperprompt_jax.model import network

TINY = '--gin_file=models/t5_1_1_tiny.gin'
HYPERPROMPT = '--gin_file=variants/hyperprompt_global.gin'


def _run(*argv: str) -> tuple[dict, network.T5Config]:
  """`param_table ARGV --json` -> its JSON object and the T5Config that gin
  built (the configuration `main` parsed stays bound)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table_command.main([*argv, '--json']) == 0
  return json.loads(out.getvalue()), param_counts.build_network().config


def _flops(*argv: str) -> float:
  return _run(*argv, '--flops')[0]['forward_flops_per_example']


def _matmul_flops(cfg: network.T5Config, inputs: int,
                  targets: int) -> tuple[int, int]:
  """(encoder, decoder) FLOPs of the matrix products of one example's
  teacher-forced forward, 2 m n k each.

  Counted: the one-hot embedding lookups (`layers.Embed(one_hot=True)`:
  `[tokens, vocab] x [vocab, d]`), the Q / K / V / O projections, the
  attention logits QK^T and weighted values AV, the gated-GELU FFN (wi_0,
  wi_1, wo) and the output logits (not tied in T5.1.1). Cross-attention's K
  and V project the encoder output, so they scale with `inputs`. The
  relative-position bias is a gather, not a matmul.
  """
  d, v, f = cfg.emb_dim, cfg.vocab_size, cfg.mlp_dim
  j = cfg.num_heads * cfg.head_dim
  assert cfg.mlp_activations == ('gelu', 'linear')
  assert not cfg.logits_via_embedding
  ffn = lambda n: 3 * 2 * n * d * f
  attention = lambda nq, nk: (2 * 2 * nq * d * j + 2 * 2 * nk * d * j
                              + 2 * 2 * nq * nk * j)
  encoder = 2 * inputs * v * d + cfg.num_encoder_layers * (
      attention(inputs, inputs) + ffn(inputs))
  decoder = 2 * targets * v * d + cfg.num_decoder_layers * (
      attention(targets, targets) + attention(targets, inputs)
      + ffn(targets)) + 2 * targets * d * v
  return encoder, decoder


@pytest.mark.parametrize('inputs, targets', [(16, 4), (32, 8), (64, 16)])
def test_mtl_flops_are_the_matmuls_plus_a_little(inputs, targets):
  summary, cfg = _run(TINY, '--flops', f'--input_length={inputs}',
                      f'--target_length={targets}')
  assert (cfg.emb_dim, cfg.num_heads, cfg.head_dim) == (32, 4, 8)
  got = summary['forward_flops_per_example']
  want = sum(_matmul_flops(cfg, inputs, targets))
  # XLA counts a multiply-add as 2 FLOPs (a lone [m, k] x [k, n] dot reports
  # exactly 2 m k n; at 1 per FMA it would report about half of `want`), so
  # the matmuls are a lower bound. On top come elementwise ops at 1 FLOP per
  # element: about 10 per attention logit (bias and mask adds, mask compare
  # and select, softmax's max, subtract, sum and divide; exp is counted as a
  # transcendental, apart) against 4 * head_dim = 32 matmul FLOPs per logit
  # here, plus norms, GELU, residual adds and the one-hot compares. Measured
  # want / got: 0.955, 0.945, 0.929 at these lengths (0.994 at T5.1.1-base,
  # 512 / 32, head_dim 64). 0.9 leaves room for that elementwise share yet
  # catches a missing kind of matmul: leaving out the FFN's wi_1 or the
  # output logits (5-10% of the total here) takes want / got below 0.9.
  assert 0.9 * got <= want <= got


def test_flops_grow_with_input_length_as_the_hand_count():
  short, cfg = _run(TINY, '--flops', '--input_length=32', '--target_length=4')
  long = _flops(TINY, '--flops', '--input_length=64', '--target_length=4')
  encoder, decoder = _matmul_flops(cfg, 32, 4)
  assert encoder > 3 * decoder  # encoder-dominated, so the ratio means much
  ratio = long / short['forward_flops_per_example']
  # Linear terms (projections, FFN, embedding, cross-attention) double; the
  # encoder's QK^T and AV quadruple, and at d = 32 they are a tenth of its
  # matmuls at input 32, so the hand count gives 2.04 and XLA 2.08 (its
  # elementwise softmax work also grows as I^2).
  assert 1.5 < ratio < 2.5
  want = sum(_matmul_flops(cfg, 64, 4)) / (encoder + decoder)
  assert ratio == pytest.approx(want, rel=0.05)


def test_batch_spreads_the_per_task_cost():
  """Per-example FLOPs at batch b are `c + k / b`: `k` is computed once per
  forward (for HyperPrompt, the prompts of all T tasks)."""
  lengths = ('--input_length=32', '--target_length=8')
  mtl = {b: _flops(TINY, *lengths, f'--batch_size={b}') for b in (1, 2, 4)}
  hp = {b: _flops(TINY, HYPERPROMPT, *lengths, f'--batch_size={b}')
        for b in (1, 2, 4)}
  assert mtl[4] == pytest.approx(mtl[1], rel=0.01)
  assert hp[4] < hp[1]
  # Prompts lengthen every attention, whatever the batch.
  assert hp[4] > mtl[4]
  for per_example in (mtl, hp):
    total = {b: b * f for b, f in per_example.items()}
    assert total[4] - total[2] == pytest.approx(2 * (total[2] - total[1]),
                                                rel=1e-6)


def test_flops_flag_in_json_and_table():
  argv = [TINY, '--flops', '--input_length=16', '--target_length=4',
          '--batch_size=2']
  summary, _ = _run(*argv)
  assert summary['forward_flops_per_example'] > 0
  assert (summary['flops_input_length'], summary['flops_target_length'],
          summary['flops_batch_size']) == (16, 4, 2)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table_command.main(argv) == 0
  line = out.getvalue().splitlines()[-1]
  assert line == ('forward FLOPs / example (input 16, target 4, batch 2): '
                  f'{summary["forward_flops_per_example"]:.3e}')
  plain, _ = _run(TINY)
  assert not [k for k in plain if k.startswith(('flops', 'forward_flops'))]


@pytest.mark.parametrize('flag', ['input_length', 'target_length',
                                  'batch_size'])
@pytest.mark.parametrize('value', ['0', '-3', 'x'])
def test_bad_length_or_batch_is_a_usage_error(capsys, flag, value):
  with pytest.raises(SystemExit) as exit_:
    param_table_command.main([TINY, '--flops', f'--{flag}={value}'])
  assert exit_.value.code == 2
  assert f'--{flag} must be a positive integer' in capsys.readouterr().err
