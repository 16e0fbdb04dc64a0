"""The memory table of `benchmark --memory`."""

import dataclasses

from flax import traverse_util
import numpy as np
import pytest

import conftest
from hyperprompt_jax.benchmarks import memory_table
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.model import network


@pytest.mark.parametrize('batch, limit, want', [
    (8, 200, 1), (8, 50, 4), (8, 25, 8), (8, 10, None),
    (6, 50, None),  # 4 and 8 do not divide 6 rows
])
def test_smallest_fitting_is_the_first_power_of_two_that_fits(batch, limit,
                                                              want):
  peaks = {1: 100, 2: 60, 4: 30, 8: 20}
  asked = []

  def peak_of(n):
    asked.append(n)
    return peaks[n]

  assert memory_table.smallest_fitting(peak_of, batch, limit) == want
  if want is not None:  # no compilation past the first fit
    assert asked[-1] == want


def test_the_paper_setups_are_read_from_their_run_files():
  """HyperGrid LG: T5 v1.0 Base, batch 128 of 512 / 32, packed rows
  (the paper's setup, gin/setups/hypergrid_lg_glue_super_glue.gin)."""
  setup = memory_table.read_setup('hypergrid_lg_glue_super_glue')
  assert (setup.batch_size, setup.input_length, setup.target_length,
          setup.pack) == (128, 512, 32, True)
  assert (setup.config.emb_dim, setup.config.num_encoder_layers,
          setup.config.hypergrid.variant) == (768, 12, 'lg')
  quickstart = memory_table.read_setup('quickstart')
  assert (quickstart.batch_size, quickstart.input_length,
          quickstart.target_length, quickstart.pack) == (32, 128, 16, False)


def test_a_setup_takes_added_gin_files_such_as_a_model_size():
  """`<run>+models/t5_1_1_large`: the run at T5.1.1 Large (d_model 1024, 24
  layers; the T5.1.1 paper's sizes), the run's batch and method kept."""
  setup = memory_table.read_setup(
      'hyperprompt_global_glue+models/t5_1_1_large')
  assert (setup.config.emb_dim, setup.config.num_encoder_layers,
          setup.config.num_decoder_layers) == (1024, 24, 24)
  assert setup.config.hyperprompt.variant == 'global'
  assert (setup.batch_size, setup.input_length) == (128, 512)
  for bad in ('+models/t5_1_1_large', 'mtl_glue+'):
    with pytest.raises(ValueError, match='expected <run>'):
      memory_table.read_setup(bad)


def test_step_bytes_hold_the_state_and_fall_with_parts_and_remat():
  """Compiled, never run. A configuration whose activations dominate
  (batch 16 of 256 tokens): the arguments hold at least the float32
  parameters; 4 microbatches cut the temporaries by more than half, and
  'full' remat does not add to them."""
  cfg = dataclasses.replace(conftest.T5X_TINY_CONFIG, vocab_size=256,
                            emb_dim=64, mlp_dim=256, head_dim=32)
  params = network.abstract_variables(network.Transformer(cfg))['params']
  param_bytes = 4 * sum(int(np.prod(v.shape)) for v in
                        traverse_util.flatten_dict(params).values())
  got = {(policy, n): memory_table.step_bytes(
      dataclasses.replace(cfg, remat_policy=policy), 16, 256, 32, False, n)
         for policy in ('none', 'full') for n in (1, 4)}
  for m in got.values():
    assert m['arguments'] >= param_bytes
    assert m['peak'] <= m['arguments'] + m['outputs'] + m['temporaries']
  assert got[('none', 4)]['temporaries'] < got[('none', 1)]['temporaries'] / 2
  assert got[('full', 1)]['temporaries'] <= got[('none', 1)]['temporaries']


def test_full_remat_peak_drops_what_full_remat_no_longer_keeps():
  assert memory_table.full_remat_peak(100, 60, 10) == 50
  assert memory_table.full_remat_peak(100, 10, 20) == 100  # never above


def test_saved_bytes_of_abstract_shapes_match_concrete_ones():
  """Traced for shapes only (an 11B setup needs no memory): the same bytes
  as for a concrete batch and parameters."""
  cfg = conftest.T5X_TINY_CONFIG
  abstract = memory_table.saved_bytes(cfg, 4, 16, 8, False)
  model = network.Transformer(cfg)
  concrete = timing.saved_activation_bytes(
      model, timing.fresh_params(model, 16, 8),
      timing.random_batch(np.random.default_rng(0), 4, 16, 8,
                          cfg.vocab_size, cfg.num_tasks))
  assert abstract == concrete > 0
