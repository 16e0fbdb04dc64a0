"""HyperPrompt against an independent numpy re-derivation of Eqs. (1)-(8)."""

import dataclasses

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_hyperprompt
import numpy_t5
from conftest import T5X_TINY_CONFIG, decode_with_cache, decoder_inputs
from conftest import flat, random_tokens
import conftest
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.model import network

TASKS = 3


def _config(variant='global', placement='both', **kwargs):
  hp = hyperprompt.HyperPromptConfig(
      variant=variant, placement=placement, encoder_prompt_length=3,
      decoder_prompt_length=2, hypernet_reduction=8, task_embed_dim=5,
      task_hidden_dim=7, layer_task_embed_dim=6, **kwargs)
  return dataclasses.replace(T5X_TINY_CONFIG, num_tasks=TASKS, hyperprompt=hp)


def _bound(inputs, targets=0, cfg=None):
  """float32 rounding of the forward pass at these lengths with the prompts
  (`conftest.float32_bound`): the network's reductions and the prompt
  generator's (task projector, generator, down and up projections),
  relative to the output's largest entry."""
  cfg = cfg or _config()
  hp = cfg.hyperprompt
  return conftest.float32_bound(
      *conftest.t5_forward_lengths(cfg, inputs, targets,
                                   hp.encoder_prompt_length,
                                   hp.decoder_prompt_length),
      2 * hp.task_embed_dim, hp.task_hidden_dim, hp.layer_task_embed_dim,
      cfg.emb_dim, cfg.emb_dim // hp.hypernet_reduction)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  enc = random_tokens(rng, (4, 7), pad_from=[7, 5, 3, 6])
  tgt = random_tokens(rng, (4, 5), pad_from=[5, 4, 2, 5])
  dec_in = np.concatenate([np.zeros((4, 1), np.int32), tgt[:, :-1]], 1)
  dec_in = np.where(tgt > 0, dec_in, 0)
  task_ids = np.array([2, 0, 1, 2], np.int32)
  return enc, dec_in, tgt, task_ids


def _init(cfg, seed=0, shapes_only=False):
  model = network.Transformer(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  init = lambda r: model.init(r, enc, dec_in, tgt, enable_dropout=False,
                              task_ids=task_ids)['params']
  rng = jax.random.PRNGKey(seed)
  return model, (jax.eval_shape(init, rng) if shapes_only
                 else jax.jit(init)(rng))


def _reference(cfg, p, enc, dec_in, tgt, task_ids):
  hp = cfg.hyperprompt
  stacks = {}
  for stack, layers in (('encoder', cfg.num_encoder_layers),
                        ('decoder', cfg.num_decoder_layers)):
    if hyperprompt.prompt_length_for(hp, stack):
      stacks[stack] = numpy_hyperprompt.stack_prompts(
          p, stack, hp.variant, layers, cfg.num_heads)
  out = []
  for e, d, t, task in zip(enc, dec_in, tgt, task_ids):
    per_layer = lambda stack, n: (
        [stacks[stack][task, m] for m in range(n)] if stack in stacks
        else None)
    encoded = numpy_t5.encode(p, e, cfg.num_heads, cfg.num_encoder_layers,
                              prompts=per_layer('encoder',
                                                cfg.num_encoder_layers))
    out.append(numpy_t5.decode(
        p, encoded, e, d, t, cfg.num_heads, cfg.num_decoder_layers,
        prompts=per_layer('decoder', cfg.num_decoder_layers)))
  return np.stack(out)


@pytest.mark.parametrize('variant', ['share', 'sep', 'global'])
@pytest.mark.parametrize('placement', ['both', 'encoder', 'decoder'])
def test_variant_matches_numpy_rederivation(variant, placement):
  cfg = _config(variant, placement)
  model, params = _init(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  p = flat(params)
  has = {s: any(k.startswith(f'{s}/hyperprompt/') for k in p)
         for s in ('encoder', 'decoder')}
  assert has == {'encoder': placement != 'decoder',
                 'decoder': placement != 'encoder'}
  apply = jax.jit(lambda p, ids: model.apply(
      {'params': p}, enc, dec_in, tgt, enable_dropout=False, task_ids=ids))
  logits = apply(params, task_ids)
  want = _reference(cfg, p, enc, dec_in, tgt, task_ids)
  valid = tgt > 0
  bound = _bound(7, 5, cfg)
  conftest.assert_close_to_scale(np.asarray(logits)[valid], want[valid],
                                 bound)
  # The prompts matter: other task ids give other outputs.
  other = apply(params, (task_ids + 1) % TASKS)
  assert np.abs(np.asarray(other)[valid] - want[valid]).max() > (
      bound * np.abs(want[valid]).max())


def _shapes(cfg):
  """'/'-keyed parameter shapes, compiled and run nothing."""
  return traverse_util.flatten_dict(_init(cfg, shapes_only=True)[1], sep='/')


def test_parameter_shapes_follow_the_paper():
  d, heads, dh, layers = 32, 2, 16, 2
  b, te, e, t = 32 // 8, 5, 7, 6
  shapes = {k: v.shape for k, v in _shapes(_config('global')).items()
            if '/hyperprompt/' in k and k.startswith('decoder/')}
  pre = 'decoder/hyperprompt/'
  assert shapes == {
      pre + 'global_prompts': (TASKS, 2, d),
      pre + 'task_embeddings': (TASKS, te),
      pre + 'layer_embeddings': (layers, te),
      pre + 'task_projector_hidden': (2 * te, e),
      pre + 'task_projector_output': (e, t),
      pre + 'key_down_generator': (t, d * b),
      pre + 'value_down_generator': (t, d * b),
      pre + 'key_up_generator': (t, b * heads * dh),
      pre + 'value_up_generator': (t, b * heads * dh),
  }
  sep = {k: v.shape for k, v in _shapes(_config('sep')).items()
         if k.startswith('encoder/hyperprompt/')}
  assert sep['encoder/hyperprompt/key_down'] == (TASKS, layers, d, b)
  assert sep['encoder/hyperprompt/value_up'] == (TASKS, layers, b, heads * dh)
  share = {k: v.shape for k, v in _shapes(_config('share')).items()
           if k.startswith('encoder/hyperprompt/')}
  assert share['encoder/hyperprompt/key_down'] == (layers, d, b)


@pytest.mark.parametrize('hp', [
    dict(variant='none'),
    dict(encoder_prompt_length=0, decoder_prompt_length=0),
])
def test_no_prompts_is_exactly_the_mtl_network(hp):
  base = dataclasses.replace(T5X_TINY_CONFIG, num_tasks=TASKS)
  cfg = dataclasses.replace(base, hyperprompt=dataclasses.replace(
      _config().hyperprompt, **hp))
  mtl_model, mtl_params = _init(base)
  model, params = _init(cfg)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape,
                                                         mtl_params)
  enc, dec_in, tgt, task_ids = _batch()
  run = lambda m: np.asarray(m.apply({'params': mtl_params}, enc, dec_in, tgt,
                                     enable_dropout=False, task_ids=task_ids))
  np.testing.assert_array_equal(run(model), run(mtl_model))
  assert not network.is_task_conditioned(cfg)


@pytest.mark.parametrize('variant', ['share', 'global'])
def test_cached_decoding_equals_teacher_forcing_with_prompts(variant):
  cfg = _config(variant, 'both', learned_prompt_bias=True)
  model, params = _init(cfg)
  # Give the learned prompt bias non-zero values so it is exercised.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.5 if 'prompt_logit_bias' in str(path) else x,
      params)
  enc, _, _, task_ids = _batch()
  tgt = random_tokens(np.random.default_rng(5), (4, 6))
  dec_in = decoder_inputs(tgt)
  full = model.apply({'params': params}, enc, dec_in, tgt,
                     enable_dropout=False, task_ids=task_ids)
  # No task ids at decode steps: the prompts must come from the cache (a
  # regeneration would raise for the missing ids).
  got, cache = decode_with_cache(model, params, enc, dec_in, task_ids,
                                 step_task_ids=None)
  layer0 = cache['decoder']['layers_0']['self_attention']
  # The gathered prompts are their own batch-major cache entries.
  assert layer0['cached_prefix_key'].shape == (4, 2, 2, 16)
  assert 'hyperprompt' not in cache['decoder']
  conftest.assert_close_to_scale(got, full, _bound(7, 6, cfg))


def test_prompts_are_visible_to_every_query_and_causality_holds():
  cfg = _config('global', 'decoder')
  model, params = _init(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  run = lambda d: np.asarray(model.apply(
      {'params': params}, enc, d, tgt, enable_dropout=False,
      task_ids=task_ids))
  before = run(dec_in)
  changed = dec_in.copy()
  changed[:, 3] = changed[:, 3] % 383 + 1
  after = run(changed)
  # Exact: a masked score is -1e10 whatever the token, its weight exp() = 0.
  np.testing.assert_array_equal(after[:, :3], before[:, :3])
  # The first query of each example sees the prompts: changing the prompts
  # (another task) changes position 0.
  other = np.asarray(model.apply({'params': params}, enc, dec_in, tgt,
                                 enable_dropout=False,
                                 task_ids=(task_ids + 1) % TASKS))
  assert (np.abs(other[:, 0] - before[:, 0]).max(-1)
          > _bound(7, 5, cfg) * np.abs(before).max()).all()


def test_padding_does_not_mask_prompts():
  cfg = _config('share', 'encoder')
  model, params = _init(cfg)
  task_ids = np.array([1], np.int32)
  rng = np.random.default_rng(9)
  enc = random_tokens(rng, (1, 4))
  encode = lambda tokens: np.asarray(model.apply(
      {'params': params}, tokens, enable_dropout=False, task_ids=task_ids,
      method=model.encode))
  padded = encode(np.pad(enc, ((0, 0), (0, 5))))
  conftest.assert_close_to_scale(padded[:, :4], encode(enc), _bound(9, cfg=cfg))
  p = flat(params)
  prompts = numpy_hyperprompt.stack_prompts(p, 'encoder', 'share', 2, 2)
  want = numpy_t5.encode(p, enc[0], 2, 2, prompts=[prompts[1, 0],
                                                   prompts[1, 1]])
  conftest.assert_close_to_scale(padded[0, :4], want, _bound(9, cfg=cfg))


def test_prompt_cost_does_not_grow_with_batch():
  """The hypernetworks run once per forward for all T tasks: the FLOPs the
  generator adds are the same at batch 2 and batch 16."""
  cfg = _config('global', 'both')
  mtl = dataclasses.replace(cfg, hyperprompt=None)

  def flops(c, batch):
    model = network.Transformer(c)
    enc = np.ones((batch, 7), np.int32)
    dec = np.ones((batch, 5), np.int32)
    ids = np.zeros((batch,), np.int32)
    params = jax.eval_shape(lambda: model.init(  # shapes: only compiled
        jax.random.PRNGKey(0), enc, dec, dec, enable_dropout=False,
        task_ids=ids)['params'])
    fn = jax.jit(lambda p: model.apply({'params': p}, enc, dec, dec,
                                       enable_dropout=False, task_ids=ids))
    return fn.lower(params).compile().cost_analysis()['flops']

  # Per example, HyperPrompt adds only the attention to its prompts: the
  # matmuls, 2 (QK and AV) * 2 (mul-add) * heads * head_dim * q_len * l per
  # layer, and the softmax's elementwise work on those prefix scores (a
  # handful of FLOPs each: bias, max, exp, sum, divide).
  heads, head_dim = cfg.num_heads, cfg.head_dim
  prefix_scores = heads * (7 * 3 * 2 + 5 * 2 * 2)
  matmuls = 4 * head_dim * prefix_scores
  extra = {b: flops(cfg, b) - flops(mtl, b) for b in (2, 16)}
  per_example = (extra[16] - extra[2]) / 14
  generator = extra[2] - 2 * per_example
  assert matmuls <= per_example <= matmuls + 20 * prefix_scores
  # The generator (run once) is far larger than what an example adds, so a
  # generator run per example could not pass the bound above.
  assert generator > 5 * per_example


@pytest.mark.parametrize('hp, message', [
    (dict(encoder_prompt_length=-1), 'encoder_prompt_length must be >= 0'),
    (dict(hypernet_reduction=5), 'HYPERNET_REDUCTION=5 must be a positive '
                                 'divisor of d_model=32'),
    (dict(variant='shared'), 'variant must be one of'),
    (dict(placement='cross'), 'PLACEMENT'),
])
def test_bad_configuration_raises(hp, message):
  cfg = _config()
  cfg = dataclasses.replace(cfg, hyperprompt=dataclasses.replace(
      cfg.hyperprompt, **hp))
  with pytest.raises(ValueError, match=message):
    _init(cfg)


def test_bad_inputs_raise():
  cfg = _config('global')
  model, params = _init(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  apply = lambda **kw: model.apply({'params': params}, enc, dec_in, tgt,
                                   enable_dropout=False, **kw)
  with pytest.raises(ValueError, match=r'\[0, 3\)'):
    apply(task_ids=np.array([0, 1, 3, 0], np.int32))
  with pytest.raises(ValueError, match='HyperPrompt needs task_ids'):
    apply()
  # Packed rows need each token's task (tests/test_packing.py packs).
  with pytest.raises(ValueError, match='per-token task ids'):
    apply(task_ids=task_ids, encoder_segment_ids=np.ones_like(enc),
          decoder_segment_ids=np.ones_like(tgt))


def test_experimental_cross_attention_prompts():
  cfg = _config('sep', 'decoder', cross_attention_prompts=True)
  model, params = _init(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  logits = np.asarray(model.apply({'params': params}, enc, dec_in, tgt,
                                  enable_dropout=False, task_ids=task_ids))
  p = flat(params)
  prompts = numpy_hyperprompt.stack_prompts(p, 'decoder', 'sep', 2, 2)
  for n, (e, d, t, task) in enumerate(zip(enc, dec_in, tgt, task_ids)):
    encoded = numpy_t5.encode(p, e, 2, 2)
    want = numpy_t5.decode(p, encoded, e, d, t, 2, 2,
                           prompts=[prompts[task, 0], prompts[task, 1]],
                           cross_prompts=True)
    valid = t > 0
    # Cross-attention keys: the input and the decoder's prompts.
    conftest.assert_close_to_scale(logits[n][valid], want[valid],
                                   _bound(7 + 2, 5, cfg))
  # Cached decoding reads the cross-attention prompts from the cache too.
  full_tgt = random_tokens(np.random.default_rng(2), (4, 3))
  full_in = decoder_inputs(full_tgt)
  full = model.apply({'params': params}, enc, full_in, full_tgt,
                     enable_dropout=False, task_ids=task_ids)
  got, _ = decode_with_cache(model, params, enc, full_in, task_ids,
                             step_task_ids=None)
  conftest.assert_close_to_scale(got, full, _bound(7 + 2, 3, cfg))
