"""Packed rows of mixed tasks against the same examples unpacked, one per row.

The reference is the unpacked model, already checked against the numpy
re-derivations: a packed batch (built here by a plain greedy packer, not
seqio's) must give every example's tokens the logits, the loss and the
gradients of its unpacked row. The converter's packed features are checked
against hand-written arrays.
"""

import dataclasses

import jax
import numpy as np
import pytest
import tensorflow as tf

import conftest
from conftest import T5X_TINY_CONFIG
from hyperprompt_jax.common import batches
from hyperprompt_jax.methods import adapters
from hyperprompt_jax.methods import hyperformer
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import losses
from hyperprompt_jax.t5 import task_blocks
from hyperprompt_jax.tasks import feature_converter
from hyperprompt_jax.training import trainer

TASKS = 3
PROMPT_TUNING_LENGTH = 2
# (input length, target length, task) of five examples: three share row 0
# (three different tasks), two share row 1.
EXAMPLES = ((5, 3, 2), (4, 4, 0), (3, 2, 1), (6, 3, 1), (4, 2, 1))
ROWS = ((0, 1, 2), (3, 4))


def _hyperprompt(variant, placement='both', **kwargs):
  return dict(hyperprompt=hyperprompt.HyperPromptConfig(
      variant=variant, placement=placement, encoder_prompt_length=3,
      decoder_prompt_length=2, hypernet_reduction=8, task_embed_dim=5,
      task_hidden_dim=7, layer_task_embed_dim=6, **kwargs))


def _hypergrid(variant, **kwargs):
  kwargs = dict(dict(grid_rows=2, grid_cols=16, max_segments=3), **kwargs)
  return dict(hypergrid=hypergrid.HyperGridConfig(variant=variant, **kwargs))


PACKING_VARIANTS = {
    'mtl': {},
    # Each variant once, each placement once (and the cross-attention
    # option, which reuses the decoder's prompts).
    'hyperprompt_share_decoder': _hyperprompt('share', 'decoder'),
    'hyperprompt_sep_encoder': _hyperprompt('sep', 'encoder'),
    'hyperprompt_global': _hyperprompt('global',
                                       cross_attention_prompts=True),
    # The other packed form: every task's prompts, the others masked.
    'hyperprompt_global_all_tasks': _hyperprompt(
        'global', cross_attention_prompts=True, packed_form='all_tasks'),
    'prompt_tuning': dict(prompt_tuning=prompt_tuning.PromptTuningConfig(
        prompt_length=PROMPT_TUNING_LENGTH)),
    'adapter': dict(adapter=adapters.AdapterConfig(reduction=8)),
    'hyperformer': dict(hyperformer=hyperformer.HyperFormerConfig(
        reduction=8, task_embed_dim=5, task_hidden_dim=7, projected_dim=6)),
    # The adapters' TPU kernels (Pallas's interpreter here).
    'adapter_pallas': dict(adapter=adapters.AdapterConfig(
        reduction=8, packed_form='pallas')),
    'hyperformer_pallas': dict(hyperformer=hyperformer.HyperFormerConfig(
        reduction=8, task_embed_dim=5, task_hidden_dim=7, projected_dim=6,
        packed_form='pallas')),
    # HyperGrid: every variant, target, conditioning and placement once, every
    # packed form, both sides of the token blocks (grid 2 x 16: `wo`'s
    # input copies, `wi`'s partial sums), and a bound (3) that row 1 (two
    # examples) does not fill.
    'hypergrid_lg': _hypergrid('lg', target='both'),
    'hypergrid_lg_grouped': _hypergrid('lg', target='both',
                                       packed_form='grouped'),
    'hypergrid_lg_pallas': _hypergrid('lg', target='both',
                                      packed_form='pallas'),
    'hypergrid_l2_wi_first_token': _hypergrid(
        'l2', target='wi', conditioning='first_token', grid_rows=4,
        grid_cols=8, packed_form='grouped'),
    'hypergrid_gl_decoder': _hypergrid('gl', placement='decoder'),
    'hypergrid_l_encoder': _hypergrid('l', placement='encoder'),
    'output_gating_first_token': _hypergrid(
        'output_gating', conditioning='first_token', output_gating_values=16),
}


def _config(variant):
  """`variant` on the tiny model, one encoder and one decoder layer (every
  attention a packed row masks: self, causal and cross; the layers of a
  stack all mask alike)."""
  return dataclasses.replace(T5X_TINY_CONFIG, num_tasks=TASKS,
                             num_encoder_layers=1, num_decoder_layers=1,
                             **PACKING_VARIANTS[variant])


def _examples(seed):
  """`[(inputs, targets, task)]`, random tokens in [2, vocab)."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(2, 384, size=a).astype(np.int32),
           rng.integers(2, 384, size=b).astype(np.int32), task)
          for a, b, task in EXAMPLES]


def _unpacked(examples, input_length, target_length):
  n = len(examples)
  batch = {k: np.zeros((n, input_length if k == 'encoder_input_tokens'
                        else target_length), np.int32)
           for k in ('encoder_input_tokens', 'decoder_input_tokens',
                     'decoder_target_tokens', 'decoder_loss_weights')}
  batch['task_ids'] = np.array([t for _, _, t in examples], np.int32)
  for i, (inputs, targets, _) in enumerate(examples):
    batch['encoder_input_tokens'][i, :len(inputs)] = inputs
    batch['decoder_target_tokens'][i, :len(targets)] = targets
    batch['decoder_input_tokens'][i, 1:len(targets)] = targets[:-1]
    batch['decoder_loss_weights'][i, :len(targets)] = 1
  return batch


def _packed(examples, rows, input_length, target_length, n_slots=0):
  """The packed batch, by hand: examples of a row one after the other."""
  shape = {'encoder': (len(rows), input_length),
           'decoder': (len(rows), target_length)}
  batch = {f'{stack}_{k}': np.zeros(shape[stack], np.int32)
           for stack in shape
           for k in ('segment_ids', 'positions', 'task_ids')}
  for k in ('encoder_input_tokens',):
    batch[k] = np.zeros(shape['encoder'], np.int32)
  for k in ('decoder_input_tokens', 'decoder_target_tokens',
            'decoder_loss_weights'):
    batch[k] = np.zeros(shape['decoder'], np.int32)
  where = {}  # example -> (row, decoder start)
  for r, members in enumerate(rows):
    enc_at = dec_at = 0
    for segment, i in enumerate(members, start=1):
      inputs, targets, task = examples[i]
      inputs = np.concatenate(
          [np.full(n_slots, feature_converter.PROMPT_SLOT_TOKEN, np.int32),
           inputs])
      e = slice(enc_at, enc_at + len(inputs))
      d = slice(dec_at, dec_at + len(targets))
      batch['encoder_input_tokens'][r, e] = inputs
      batch['encoder_segment_ids'][r, e] = segment
      batch['encoder_positions'][r, e] = np.arange(len(inputs))
      batch['encoder_task_ids'][r, e] = task
      batch['decoder_target_tokens'][r, d] = targets
      batch['decoder_input_tokens'][r, d] = np.concatenate([[0],
                                                            targets[:-1]])
      batch['decoder_loss_weights'][r, d] = 1
      batch['decoder_segment_ids'][r, d] = segment
      batch['decoder_positions'][r, d] = np.arange(len(targets))
      batch['decoder_task_ids'][r, d] = task
      where[i] = (r, dec_at)
      enc_at, dec_at = e.stop, d.stop
  return batch, where


def _forward_lengths(cfg):
  """The reductions of the packed forward pass up to the logits: the
  network's at the packed lengths (22, 10), every task's prompts or soft
  prompt slots more keys, and per layer one more attention and projection
  pair (a method's conditioning, gate or adapter)."""
  joined = cfg.num_heads * cfg.head_dim
  method = [cfg.emb_dim, cfg.head_dim, 22 + 1, joined, cfg.emb_dim,
            cfg.emb_dim] * (cfg.num_encoder_layers + cfg.num_decoder_layers)
  hypernetwork = [cfg.emb_dim] * 5
  return conftest.t5_forward_lengths(
      cfg, 22 + TASKS * 3 + PROMPT_TUNING_LENGTH * len(EXAMPLES), 10,
      0, TASKS * 2) + method + hypernetwork


def _logits(model, params, batch):
  return model.apply({'params': params}, batch['encoder_input_tokens'],
                     batch['decoder_input_tokens'],
                     batch['decoder_target_tokens'], enable_dropout=False,
                     **trainer.model_inputs(batch))


@pytest.fixture(scope='module', params=sorted(PACKING_VARIANTS))
def variant_outputs(request):
  """Logits, loss and gradients of the examples unpacked and packed."""
  cfg = _config(request.param)
  model = network.Transformer(cfg)
  n_slots = prompt_tuning.prompt_length(cfg.prompt_tuning)
  examples = _examples(0)
  unpacked = _unpacked(examples, 8, 5)
  packed, where = _packed(examples, ROWS, 22, 10, n_slots)

  # Non-zero everywhere (zero-initialised parts would compare trivially):
  # the initialisation, compiled, plus noise drawn in numpy.
  noise = np.random.default_rng(2)
  params = jax.tree.map(
      lambda leaf: leaf + 0.05 * noise.normal(size=leaf.shape).astype(
          leaf.dtype),
      jax.device_get(jax.jit(lambda rng: network.init_variables(
          model, rng)['params'])(jax.random.PRNGKey(1))))

  @jax.jit
  def loss_grads_logits(p, b):
    def loss(p):
      out = _logits(model, p, b)
      terms = losses.cross_entropy_with_z_loss(
          out, b['decoder_target_tokens'], b['decoder_loss_weights'], 1e-4)
      return terms['loss'], out
    return jax.value_and_grad(loss, has_aux=True)(p)

  out = {}
  for name, batch in (('unpacked', unpacked), ('packed', packed)):
    (loss, batch_logits), grads = loss_grads_logits(params, batch)
    out[name] = dict(logits=np.asarray(batch_logits), loss=float(loss),
                     grads=grads)
  return dict(variant=request.param, model=model, params=params,
              examples=examples, packed_batch=packed, where=where,
              logits=lambda p, b: loss_grads_logits(p, b)[0][1],
              n_slots=n_slots, **out)


def test_packed_logits_are_the_unpacked_logits(variant_outputs):
  o = variant_outputs
  for i, (_, targets, _) in enumerate(o['examples']):
    row, start = o['where'][i]
    conftest.assert_close_to_scale(
        o['packed']['logits'][row, start:start + len(targets)],
        o['unpacked']['logits'][i, :len(targets)],
        conftest.float32_bound(*_forward_lengths(o['model'].config)),
        name=f"{o['variant']}: example {i}")


def test_packed_loss_and_gradients_are_the_unpacked_ones(variant_outputs):
  o = variant_outputs
  # The loss: the forward pass, the softmax over the vocabulary, the sum
  # over the tokens; the gradients: the loss's reductions twice, then a
  # weight's sum over the tokens. Each relative to the tensor's largest.
  cfg = o['model'].config
  tokens = sum(len(targets) for _, targets, _ in o['examples'])
  forward = _forward_lengths(cfg) + [cfg.vocab_size]
  conftest.assert_close_to_scale(
      o['packed']['loss'], o['unpacked']['loss'],
      conftest.float32_bound(*forward, tokens), name=o['variant'])
  flat = lambda g: dict(jax.tree_util.tree_flatten_with_path(g)[0])
  packed, unpacked = flat(o['packed']['grads']), flat(o['unpacked']['grads'])
  bound = conftest.float32_bound(*forward * 2, len(ROWS) * 22)
  for path, grad in unpacked.items():
    conftest.assert_close_to_scale(
        packed[path], grad, bound,
        name=f"{o['variant']}: {jax.tree_util.keystr(path)}")


def test_other_segments_do_not_reach_a_segment(variant_outputs):
  """Row 0's first example keeps its logits when its row-mates change
  tokens and tasks."""
  o = variant_outputs
  changed = {k: v.copy() for k, v in o['packed_batch'].items()}
  rng = np.random.default_rng(7)
  for stack, tokens in (('encoder', 'encoder_input_tokens'),
                        ('decoder', 'decoder_target_tokens')):
    others = changed[f'{stack}_segment_ids'][0] > 1
    changed[tokens][0, others] = rng.integers(2, 384, size=others.sum())
    changed[f'{stack}_task_ids'][0, others] = (
        changed[f'{stack}_task_ids'][0, others] + 1) % TASKS
  if o['n_slots']:  # the placeholders stay where the packer put them
    slots = o['packed_batch']['encoder_input_tokens'][0] == (
        feature_converter.PROMPT_SLOT_TOKEN)
    changed['encoder_input_tokens'][0, slots] = (
        feature_converter.PROMPT_SLOT_TOKEN)
  targets = changed['decoder_target_tokens']
  changed['decoder_input_tokens'] = np.where(
      changed['decoder_positions'] > 0, np.roll(targets, 1, axis=1), 0)
  logits = np.asarray(o['logits'](o['params'], changed))
  length = len(o['examples'][0][1])
  conftest.assert_close_to_scale(
      logits[0, :length], o['packed']['logits'][0, :length],
      conftest.float32_bound(*_forward_lengths(o['model'].config)),
      name=o['variant'])


# -- refusals and bad input -----------------------------------------------


def _gated_init(batch, **kwargs):
  cfg = dataclasses.replace(
      T5X_TINY_CONFIG, num_tasks=TASKS, hypergrid=hypergrid.HyperGridConfig(
          grid_rows=4, grid_cols=8, **kwargs))
  model = network.Transformer(cfg)
  return lambda: model.init(
      jax.random.PRNGKey(0), batch['encoder_input_tokens'],
      batch['decoder_input_tokens'], batch['decoder_target_tokens'],
      enable_dropout=False, **trainer.model_inputs(batch))


def test_gating_refuses_rows_over_max_segments():
  batch, _ = _packed(_examples(0), ROWS, 22, 10)  # row 0 holds 3 examples
  with pytest.raises(ValueError, match='over MAX_SEGMENTS=2'):
    jax.eval_shape(_gated_init(batch, max_segments=2))
  jax.eval_shape(_gated_init(batch, max_segments=3))
  # Traced ids: the compiled program refuses them.
  with pytest.raises(Exception, match='over MAX_SEGMENTS=2'):
    jax.jit(lambda b: _gated_init(b, max_segments=2, variant='l')())(batch)


def test_gating_refuses_segments_out_of_order():
  batch, _ = _packed(_examples(0), ROWS, 22, 10)
  for stack in ('encoder', 'decoder'):
    for k in ('segment_ids', 'task_ids'):
      batch[f'{stack}_{k}'][0] = batch[f'{stack}_{k}'][0][::-1].copy()
  with pytest.raises(ValueError, match='contiguous, in order'):
    jax.eval_shape(_gated_init(batch, max_segments=3))


def test_packed_rows_need_per_token_task_ids():
  model = network.Transformer(_config('hyperprompt_global'))
  batch, _ = _packed(_examples(0), ROWS, 22, 10)
  with pytest.raises(ValueError, match='per-token task ids'):
    model.init(jax.random.PRNGKey(0), batch['encoder_input_tokens'],
               batch['decoder_input_tokens'], batch['decoder_target_tokens'],
               encoder_segment_ids=batch['encoder_segment_ids'],
               decoder_segment_ids=batch['decoder_segment_ids'],
               enable_dropout=False, task_ids=np.zeros(2, np.int32))


def test_a_segment_with_two_task_ids_is_refused():
  batch, _ = _packed(_examples(0), ROWS, 22, 10)
  batch['encoder_task_ids'][0, 1] = (batch['encoder_task_ids'][0, 0] + 1) % 3
  with pytest.raises(ValueError, match='segment 1 of row 0 carries task ids'):
    batches.validate_batch(batch, TASKS, 384,
                           rows=batches.RowFormat(packed=True))
  model = network.Transformer(_config('adapter'))
  with pytest.raises(ValueError, match='segment 1 of row 0 carries task ids'):
    model.init(jax.random.PRNGKey(0), batch['encoder_input_tokens'],
               batch['decoder_input_tokens'], batch['decoder_target_tokens'],
               enable_dropout=False, **trainer.model_inputs(batch))


# -- the converter ---------------------------------------------------------


def _dataset(examples):
  return tf.data.Dataset.from_generator(
      lambda: ({'inputs': np.array(i, np.int32),
                'targets': np.array(t, np.int32), 'task_ids': np.int32(k)}
               for i, t, k in examples),
      output_signature={'inputs': tf.TensorSpec([None], tf.int32),
                        'targets': tf.TensorSpec([None], tf.int32),
                        'task_ids': tf.TensorSpec([], tf.int32)})


MIXTURE = (([7, 8, 5, 1], [3, 9, 1], 2), ([8, 4, 9, 3, 1], [4, 1], 0),
           ([6, 1], [5, 1], 1))


def test_converter_packs_per_token_task_ids():
  converter = feature_converter.TaskIdsEncDecFeatureConverter(pack=True)
  (row,) = list(converter(_dataset(MIXTURE),
                          {'inputs': 12, 'targets': 7}).as_numpy_iterator())
  expected = {
      'encoder_input_tokens': [7, 8, 5, 1, 8, 4, 9, 3, 1, 6, 1, 0],
      'encoder_segment_ids': [1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0],
      'encoder_positions': [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0],
      'encoder_task_ids': [2, 2, 2, 2, 0, 0, 0, 0, 0, 1, 1, 0],
      'decoder_target_tokens': [3, 9, 1, 4, 1, 5, 1],
      'decoder_input_tokens': [0, 3, 9, 0, 4, 0, 5],
      'decoder_loss_weights': [1, 1, 1, 1, 1, 1, 1],
      'decoder_segment_ids': [1, 1, 1, 2, 2, 3, 3],
      'decoder_positions': [0, 1, 2, 0, 1, 0, 1],
      'decoder_task_ids': [2, 2, 2, 0, 0, 1, 1],
  }
  assert sorted(row) == sorted(expected)
  for k, v in expected.items():
    np.testing.assert_array_equal(row[k], v, err_msg=k)
  assert converter.get_model_feature_lengths(
      {'inputs': 12, 'targets': 7})['encoder_task_ids'] == 12


def test_converter_reserves_prompt_tuning_slots():
  converter = feature_converter.TaskIdsEncDecFeatureConverter(
      pack=True, input_prompt_length=2)
  rows = list(converter(_dataset(MIXTURE),
                        {'inputs': 12, 'targets': 7}).as_numpy_iterator())
  slot = feature_converter.PROMPT_SLOT_TOKEN
  # Best fit (hand-packed). With its slots, the examples are (6, 3), (7, 2)
  # and (4, 2) positions of (12, 7); inputs are the scarce feature (mean
  # 17 / 36 of a row against 7 / 21): weights 1 and (0.333 / 0.472)^6 =
  # 0.124. On the empty row, the second then the third leaves (1, 3), room
  # max(1 / 12, 0.124 * 3 / 7) = 0.083, and so does the third then the
  # second; the first at best leaves (2, 2), 0.167. Ties go to the oldest:
  # row 0 takes the second, then the third (the first no longer fits),
  # and the first gets row 1.
  np.testing.assert_array_equal(
      rows[0]['encoder_input_tokens'],
      [slot, slot, 8, 4, 9, 3, 1, slot, slot, 6, 1, 0])
  np.testing.assert_array_equal(rows[0]['encoder_positions'],
                                [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0])
  np.testing.assert_array_equal(rows[0]['encoder_task_ids'],
                                [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(
      rows[1]['encoder_input_tokens'],
      [slot, slot, 7, 8, 5, 1, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(rows[1]['encoder_task_ids'],
                                [2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0])
  assert len(rows) == 2


def test_converter_without_task_ids_says_so():
  ds = _dataset(MIXTURE).map(lambda ex: {'inputs': ex['inputs'],
                                         'targets': ex['targets']})
  converter = feature_converter.TaskIdsEncDecFeatureConverter(pack=True)
  with pytest.raises(ValueError, match="no 'task_ids' feature"):
    converter(ds, {'inputs': 12, 'targets': 7})


def test_unpacked_converter_keeps_task_ids_per_example():
  converter = feature_converter.TaskIdsEncDecFeatureConverter(pack=False)
  rows = list(converter(_dataset(MIXTURE),
                        {'inputs': 12, 'targets': 7}).as_numpy_iterator())
  assert [int(r['task_ids']) for r in rows] == [2, 0, 1]
  assert 'encoder_segment_ids' not in rows[0]


def test_packed_rows_without_prompt_slots_are_refused():
  rows = batches.RowFormat(packed=True, input_prompt_length=2)
  without, _ = _packed(_examples(0), ROWS, 22, 10)
  with pytest.raises(ValueError, match='input_prompt_length=2'):
    batches.validate_batch(without, TASKS, 384, rows=rows)
  with_slots, _ = _packed(_examples(0), ROWS, 22, 10, n_slots=2)
  batches.validate_batch(with_slots, TASKS, 384, rows=rows)


@pytest.mark.parametrize('shape,num_tasks,shards', [
    ((8, 512), 8, 1), ((8, 512), 8, 4), ((3, 40), 5, 1), ((3, 40), 5, 3),
    ((2, 7), 8, 2)])
def test_task_blocks_hold_every_token_once_in_blocks_of_one_task(
    shape, num_tasks, shards):
  rng = np.random.default_rng(0)
  # Skewed: most tokens of one task, some tasks absent.
  ids = rng.choice(num_tasks, shape, p=np.r_[0.6, 0.3, 0.1,
                                             [0] * (num_tasks - 3)])
  count = ids.size // shards  # a shard's tokens: its rows, in order
  block = task_blocks.block_size(count, num_tasks, 16)
  blocks = task_blocks.task_blocks(jax.numpy.asarray(ids), num_tasks, block,
                                   shards)
  assert blocks.source.shape[0] == blocks.destination.shape[0] == shards
  for s in range(shards):
    source = np.asarray(blocks.source[s])
    destination = np.asarray(blocks.destination[s])
    block_tasks = np.asarray(blocks.block_tasks[s])
    flat = ids.reshape(shards, -1)[s]
    # Each token once, at its destination; the rest is padding (index n).
    real = source[source < count]
    assert sorted(real.tolist()) == list(range(count))
    np.testing.assert_array_equal(source[destination], np.arange(count))
    # Every block holds one task's tokens, in their order, and says which.
    per_block = source.reshape(len(block_tasks), -1)
    for tasks_of_block, tokens in zip(block_tasks, per_block):
      tokens = tokens[tokens < count]
      assert (flat[tokens] == tasks_of_block).all()
      assert (np.diff(tokens) > 0).all()
    # Blocks of `block`; padding at most one partial block a task (and one
    # block's rounding of the static count).
    assert per_block.shape[1] == block
    assert source.size - count <= num_tasks * (block - 1) + block
  np.testing.assert_array_equal(
      blocks.tasks, np.asarray(blocks.block_tasks).reshape(-1))


@pytest.mark.parametrize('count,num_tasks,copied_rows,block', [
    (4096, 8, 64, 181),  # HyperFormer++'s adapters, b = 32: sqrt(32768)
    (4096, 8, 32, 128),  # the Vanilla adapter's (b = 16), l = 16 prompts
    (256, 8, 64, 45),    # sqrt(2048) = 45.25
    (7, 8, 16, 4),       # sqrt(14) = 3.74
    (3, 1, 128, 3),      # sqrt(384) = 19.6, at most the token count
])
def test_block_size_balances_weight_copies_and_padding(count, num_tasks,
                                                        copied_rows, block):
  """c = sqrt(w N / T) minimises (N / c + T) w + T c (copies and static
  padding); checked here against the minimum found by search as well."""
  assert task_blocks.block_size(count, num_tasks, copied_rows) == block
  cost = lambda c: (count / c + num_tasks) * copied_rows + num_tasks * c
  best = min(range(1, count + 1), key=cost)
  assert abs(cost(block) - cost(best)) <= 0.01 * cost(best)


@pytest.mark.parametrize('shards', [1, 2])
def test_blocks_permutation_gradient_is_the_gathers(shards):
  """`to_blocks` / `from_blocks` carry gathers as their gradients; they
  must equal the gradient of the plain indexing they stand for (shard s's
  tokens are rows [30 s, 30 s + 30) of x, its blocks after shard s - 1's)."""
  rng = np.random.default_rng(1)
  ids = jax.numpy.asarray(rng.integers(0, 4, (2, 30)))
  blocks = task_blocks.task_blocks(ids, 4, 7, shards)
  x = jax.numpy.asarray(rng.normal(size=(60, 5)), jax.numpy.float32)
  weights = jax.numpy.asarray(rng.normal(size=(60, 5)), jax.numpy.float32)
  n, positions = 60 // shards, blocks.source.shape[1]
  offset = np.arange(shards)[:, None]
  source = np.where(blocks.source < n, blocks.source + offset * n, 60)
  destination = np.asarray(blocks.destination) + offset * positions

  def through_blocks(x):
    y = blocks.to_blocks(x)
    return jax.numpy.sum(jax.numpy.sin(blocks.from_blocks(y * 2.0)) * weights)

  def plain(x):
    padded = jax.numpy.concatenate([x, jax.numpy.zeros_like(x[:1])])
    y = padded[source.reshape(-1)] * 2.0
    return jax.numpy.sum(jax.numpy.sin(y[destination.reshape(-1)]) * weights)

  # The value: one sum of the same 300 terms; the gradient: each entry one
  # term (the permutation moves it, nothing sums), a few products rounded.
  terms = np.abs(np.sin(2 * np.asarray(x)) * np.asarray(weights)).sum()
  conftest.assert_close_to_scale(through_blocks(x), plain(x),
                                 conftest.float32_bound(x.size), terms)
  want = jax.grad(plain)(x)
  conftest.assert_close_to_scale(jax.grad(through_blocks)(x), want,
                                 conftest.float32_bound(3), np.abs(want))


def _own_task_attention_reference(query, key, value, bias, prefix_key,
                                  prefix_value, logit_bias, task_ids, keep):
  """numpy: each query's softmax over [its own task's l prompt columns;
  the tokens], the dropout keep mask (over every task's columns, then the
  tokens) applied to those weights."""
  batch, length, heads, _ = query.shape
  prefix = prefix_key.shape[1]
  out = np.zeros(query.shape)
  for b in range(batch):
    for i in range(length):
      task = task_ids[b, i]
      columns = slice(task * prefix, (task + 1) * prefix)
      for h in range(heads):
        k = np.concatenate([prefix_key[task, :, h], key[b, :, h]])
        v = np.concatenate([prefix_value[task, :, h], value[b, :, h]])
        logits = k @ query[b, i, h]
        logits[:prefix] += logit_bias[h]
        logits[prefix:] += bias[b, h, i]
        w = np.exp(logits - logits.max())
        w /= w.sum()
        w *= np.concatenate([keep[b, h, 0, columns],
                             keep[b, h, 0, prefix_key.shape[0] * prefix:]])
        out[b, i, h] = w @ v
  return out


@pytest.mark.parametrize('dropout,shards', [(False, 1), (True, 1),
                                            (True, 2), (False, None),
                                            (True, None)])
def test_own_task_prefix_attention_is_the_softmax_over_its_columns(
    dropout, shards):
  """Packed rows' prompts (`hyperprompt.OwnTaskPrompts`, handed to the
  attention as its `prefix_attention`): each query attends over its own
  task's prompt columns and the tokens under one softmax, and dropout drops
  the same columns of a row for all its queries; in task blocks of the
  whole batch, and per data shard (each row's mask found in its shard), and
  scored against all tasks' columns, the others masked (`shards` None)."""
  rng = np.random.default_rng(3)
  batch, length, heads, head_dim, tasks, prefix = 2, 9, 2, 4, 3, 2
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  query, key, value = (normal(batch, length, heads, head_dim)
                       for _ in range(3))
  prefix_key, prefix_value = (normal(tasks, prefix, heads, head_dim)
                              for _ in range(2))
  bias, logit_bias = normal(batch, heads, length, length), normal(heads)
  task_ids = rng.integers(0, tasks, (batch, length))
  if shards is None:
    own_task = hyperprompt.OwnTaskPrompts(
        query_tasks=jax.numpy.asarray(task_ids))
  else:
    own_task = hyperprompt.OwnTaskPrompts(task_blocks.task_blocks(
        jax.numpy.asarray(task_ids), tasks, 2, shards))
  rate, dropout_rng = (0.3, jax.random.PRNGKey(5)) if dropout else (0., None)
  a = jax.numpy.asarray
  got = layers.dot_product_attention(
      a(query), a(key), a(value), a(bias), dropout_rng=dropout_rng,
      dropout_rate=rate, deterministic=not dropout, prefix_key=a(prefix_key),
      prefix_value=a(prefix_value),
      prefix_bias=a(logit_bias[None, :, None, None]),
      prefix_attention=own_task)
  keep = np.ones((batch, heads, 1, tasks * prefix + length))
  if dropout:  # the mask the attention draws (`layers.dropout_keep`)
    keep = np.asarray(layers.dropout_keep(dropout_rng, rate, np.float32,
                                          keep.shape))
    assert 0 < (keep == 0).mean() < 0.6
  want = _own_task_attention_reference(query, key, value, bias, prefix_key,
                                       prefix_value, logit_bias, task_ids,
                                       keep)
  # The scores over head_dim, the softmax and the weighted sum over every
  # column, relative to the largest output.
  conftest.assert_close_to_scale(got, want, conftest.float32_bound(
      head_dim, tasks * prefix + length, tasks * prefix + length))
