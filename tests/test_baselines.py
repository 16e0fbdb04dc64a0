"""The papers' baselines (Vanilla Adapter, HyperFormer++, multi-task
Prompt-Tuning) against independent numpy re-derivations, cached decoding,
the freeze switch and bad input."""

import dataclasses
import functools
import re

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpy_baselines
import numpy_t5
from conftest import T5X_TINY_CONFIG, decode_with_cache, decoder_inputs
from conftest import flat, random_tokens
import conftest
from hyperprompt_jax.methods import adapters
from hyperprompt_jax.methods import hyperformer
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import task_blocks
from hyperprompt_jax.training import optimizers

TASKS = 3
D = T5X_TINY_CONFIG.emb_dim  # 32


def _config(kind, placement='both', **kwargs):
  if kind == 'adapter':
    extra = dict(adapter=adapters.AdapterConfig(placement=placement,
                                                reduction=8, **kwargs))
  elif kind == 'hyperformer':
    extra = dict(hyperformer=hyperformer.HyperFormerConfig(
        placement=placement, reduction=8, task_embed_dim=5,
        task_hidden_dim=7, projected_dim=6, **kwargs))
  else:
    extra = dict(prompt_tuning=prompt_tuning.PromptTuningConfig(
        prompt_length=3, **kwargs))
  return dataclasses.replace(T5X_TINY_CONFIG, num_tasks=TASKS, **extra)


def _bound(cfg, inputs, targets=0):
  """float32 rounding of the forward pass at these lengths
  (`conftest.float32_bound`), relative to the output's largest entry: the
  network's reductions (the soft prompt more keys), each adapter's down and
  up projections after each sublayer (HyperFormer++'s also its norm over
  d_model) and HyperFormer++'s generator chain."""
  prompt = cfg.prompt_tuning.prompt_length if cfg.prompt_tuning else 0
  extra = []
  if adapter := cfg.adapter or cfg.hyperformer:
    extra += ([D, D // adapter.reduction] + [D] * bool(cfg.hyperformer)) * (
        len(adapters.KINDS) * (cfg.num_encoder_layers
                               + cfg.num_decoder_layers))
  if h := cfg.hyperformer:
    extra += [3 * h.task_embed_dim, h.task_hidden_dim, h.projected_dim,
              h.projected_dim, h.projected_dim]
  return conftest.float32_bound(
      *conftest.t5_forward_lengths(cfg, inputs + prompt, targets), *extra)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  enc = random_tokens(rng, (4, 7), pad_from=[7, 5, 3, 6])
  tgt = random_tokens(rng, (4, 5), pad_from=[5, 4, 2, 5])
  dec_in = np.where(tgt > 0, decoder_inputs(tgt), 0)
  return enc, dec_in, tgt, np.array([2, 0, 1, 2], np.int32)


@functools.lru_cache(maxsize=None)
def _init(cfg):
  """The model and its params, task-conditioned ones redrawn N(0, 0.3^2)
  (their initialisation is near zero, which would hide mistakes)."""
  model = network.Transformer(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  params = jax.jit(lambda r: model.init(
      r, enc, dec_in, tgt, enable_dropout=False, task_ids=task_ids))(
          jax.random.PRNGKey(0))['params']
  flat_params = traverse_util.flatten_dict(params, sep='/')
  rng = np.random.default_rng(1)
  for path, value in flat_params.items():
    if any(s in path.split('/') for s in ('adapter', 'hyperformer')):
      flat_params[path] = jnp.asarray(
          rng.normal(0, 0.3, value.shape), value.dtype)
  return model, traverse_util.unflatten_dict(flat_params, sep='/')


def _logits(model, params, enc, dec_in, tgt, task_ids):
  return np.asarray(jax.jit(lambda p, t: model.apply(
      {'params': p}, enc, dec_in, tgt, enable_dropout=False, task_ids=t))(
          params, task_ids))


def _reference(cfg, p, enc, dec_in, tgt, task_ids):
  stacks = {s for s in ('encoder', 'decoder')
            if adapters.is_active(cfg.adapter or cfg.hyperformer, s)}
  out = []
  for e, d, t, task in zip(enc, dec_in, tgt, task_ids):
    kwargs, soft_prompt = {}, None
    if cfg.adapter:
      kwargs['adapter_fn'] = numpy_baselines.vanilla_adapter_fn(p, task,
                                                                stacks)
    if cfg.hyperformer:
      kwargs['adapter_fn'] = numpy_baselines.hyperformer_adapter_fn(
          p, task, stacks, D, D // cfg.hyperformer.reduction)
    if cfg.prompt_tuning:
      soft_prompt = p['encoder/prompt_tuning/prompts'][task]
    encoded = numpy_t5.encode(p, e, cfg.num_heads, cfg.num_encoder_layers,
                              soft_prompt=soft_prompt, **kwargs)
    out.append(numpy_t5.decode(
        p, encoded, e, d, t, cfg.num_heads, cfg.num_decoder_layers,
        soft_prompt_length=0 if soft_prompt is None else len(soft_prompt),
        **kwargs))
  return np.stack(out)


CASES = [('adapter', 'both'), ('adapter', 'encoder'), ('adapter', 'decoder'),
         ('hyperformer', 'both'), ('hyperformer', 'decoder'),
         ('prompt_tuning', None)]


@pytest.mark.parametrize('kind, placement', CASES)
def test_baseline_matches_numpy_rederivation(kind, placement):
  cfg = _config(kind, placement) if placement else _config(kind)
  model, params = _init(cfg)
  enc, dec_in, tgt, task_ids = _batch()
  p = flat(params)
  scope = {'adapter': 'adapter', 'hyperformer': 'hyperformer',
           'prompt_tuning': 'prompt_tuning'}[kind]
  has = {s: any(k.startswith(f'{s}/') and f'/{scope}/' in k for k in p)
         for s in ('encoder', 'decoder')}
  assert has == {'encoder': placement != 'decoder',
                 'decoder': placement in ('both', 'decoder')}
  assert network.is_task_conditioned(cfg)
  got = _logits(model, params, enc, dec_in, tgt, task_ids)
  want = _reference(cfg, p, enc, dec_in, tgt, task_ids)
  valid = tgt > 0
  bound = _bound(cfg, 7, 5)
  conftest.assert_close_to_scale(got[valid], want[valid], bound)
  # The task selects the adapters / prompts: other ids, other outputs.
  other = _logits(model, params, enc, dec_in, tgt, (task_ids + 1) % TASKS)
  assert np.abs(other[valid] - want[valid]).max() > bound * np.abs(
      want[valid]).max()


def _shapes(cfg):
  enc, dec_in, tgt, task_ids = _batch()
  params = jax.eval_shape(lambda: network.Transformer(cfg).init(
      jax.random.PRNGKey(0), enc, dec_in, tgt, enable_dropout=False,
      task_ids=task_ids))['params']
  return {k: v.shape
          for k, v in traverse_util.flatten_dict(params, sep='/').items()}


def test_parameter_shapes():
  m, b, t_ = 2, D // 8, TASKS
  vanilla = {k: v for k, v in _shapes(_config('adapter')).items()
             if k.startswith('decoder/adapter/')}
  pre = 'decoder/adapter/'
  assert vanilla == {
      pre + f'{kind}_{name}': (m, t_) + shape
      for kind in ('attention', 'mlp')
      for name, shape in (('down', (D, b)), ('down_bias', (b,)),
                          ('up', (b, D)), ('up_bias', (D,)))}
  generated = {k: v for k, v in _shapes(_config('hyperformer')).items()
               if k.startswith('encoder/hyperformer/')}
  te, e, t = 5, 7, 6
  pre = 'encoder/hyperformer/'
  want = {'task_embeddings': (t_, te), 'layer_embeddings': (m, te),
          'kind_embeddings': (2, te),
          'task_projector_hidden': (3 * te, e),
          'task_projector_hidden_bias': (e,),
          'task_projector_output': (e, t), 'task_projector_output_bias': (t,),
          'task_projector_norm_scale': (t,), 'task_projector_norm_bias': (t,)}
  for name, size in (('down', D * b), ('up', b * D), ('down_bias', b),
                     ('up_bias', D), ('norm_scale', D), ('norm_bias', D)):
    want[f'{name}_generator'] = (t, size)
    want[f'{name}_generator_bias'] = (size,)
  assert generated == {pre + k: v for k, v in want.items()}
  prompts = _shapes(_config('prompt_tuning'))
  assert prompts['encoder/prompt_tuning/prompts'] == (t_, 3, D)


def test_adapters_start_near_the_identity():
  """Houlsby's initialisation: at step 0 the adapted network is close to
  the plain one (small weights, zero biases)."""
  cfg = _config('adapter')
  model = network.Transformer(cfg)
  mtl = network.Transformer(dataclasses.replace(cfg, adapter=None))
  enc, dec_in, tgt, task_ids = _batch()
  params = model.init(jax.random.PRNGKey(0), enc, dec_in, tgt,
                      enable_dropout=False, task_ids=task_ids)['params']
  backbone = {k: v for k, v in params.items()}
  for stack in ('encoder', 'decoder'):
    backbone[stack] = {k: v for k, v in params[stack].items()
                       if k != 'adapter'}
  got = _logits(model, params, enc, dec_in, tgt, task_ids)
  plain = _logits(mtl, backbone, enc, dec_in, tgt, task_ids)
  valid = tgt > 0
  assert np.max(np.abs(got - plain)[valid]) < 0.05 * np.max(np.abs(plain))


@pytest.mark.parametrize('kind, placement', [('adapter', 'decoder'),
                                             ('hyperformer', 'both'),
                                             ('prompt_tuning', None)])
def test_cached_decoding_equals_teacher_forcing(kind, placement):
  cfg = _config(kind, placement) if placement else _config(kind)
  model, params = _init(cfg)
  enc, _, _, task_ids = _batch()
  tgt = random_tokens(np.random.default_rng(5), (4, 6))
  dec_in = decoder_inputs(tgt)
  full = model.apply({'params': params}, enc, dec_in, tgt,
                     enable_dropout=False, task_ids=task_ids)
  got, _ = decode_with_cache(model, params, enc, dec_in, task_ids)
  conftest.assert_close_to_scale(got, full, _bound(cfg, 7, 6))


def test_prompt_tuning_prompts_are_always_visible():
  """Padding the input does not hide the prompt: the encoding of the prompt
  positions and of the real tokens is the same whatever the padding."""
  cfg = _config('prompt_tuning')
  model, params = _init(cfg)
  tokens = random_tokens(np.random.default_rng(3), (1, 5))
  task_ids = np.array([1], np.int32)
  encode = lambda t: np.asarray(model.apply(
      {'params': params}, t, enable_dropout=False, task_ids=task_ids,
      method=model.encode))
  short = encode(tokens)
  padded = encode(np.pad(tokens, ((0, 0), (0, 4))))
  assert short.shape == (1, 3 + 5, D) and padded.shape == (1, 3 + 9, D)
  conftest.assert_close_to_scale(padded[:, :8], short, _bound(cfg, 9))


@pytest.mark.parametrize('kind', ['adapter', 'hyperformer', 'prompt_tuning'])
def test_freeze_switch_trains_only_the_baseline(kind):
  model, params = _init(_config(kind))
  enc, dec_in, tgt, task_ids = _batch()

  def loss(p):
    return jnp.mean(model.apply({'params': p}, enc, dec_in, tgt,
                                enable_dropout=False, task_ids=task_ids) ** 2)

  optimizer = optimizers.make_optimizer(train_only_task_conditioned=True)

  @jax.jit
  def step(params):
    updates, _ = optimizer.update(jax.grad(loss)(params),
                                  optimizer.init(params), params)
    return optax.apply_updates(params, updates)

  new = traverse_util.flatten_dict(step(params), sep='/')
  old = traverse_util.flatten_dict(params, sep='/')
  changed = {k for k in old if not np.array_equal(old[k], new[k])}
  scope = kind
  assert changed == {k for k in old if scope in k.split('/')}
  assert changed


@pytest.mark.parametrize('kind', ['adapter', 'hyperformer', 'prompt_tuning'])
def test_missing_task_ids_raise(kind):
  model, params = _init(_config(kind))
  enc, dec_in, tgt, _ = _batch()
  with pytest.raises(ValueError, match='task_ids'):
    model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False)


@pytest.mark.parametrize('change, message', [
    (dict(adapter=adapters.AdapterConfig(reduction=5)),
     'ADAPTER_REDUCTION=5 must be a positive divisor of d_model=32'),
    (dict(adapter=adapters.AdapterConfig(placement='middle')),
     'PLACEMENT'),
    (dict(hyperformer=hyperformer.HyperFormerConfig(reduction=0)),
     'HYPERFORMER_REDUCTION=0'),
    (dict(hyperformer=hyperformer.HyperFormerConfig(projected_dim=0)),
     'projected_dim must be positive'),
    (dict(adapter=adapters.AdapterConfig(),
          hyperformer=hyperformer.HyperFormerConfig()),
     'include one of'),
    (dict(prompt_tuning=prompt_tuning.PromptTuningConfig(prompt_length=0)),
     'PROMPT_TUNING_LENGTH'),
    (dict(adapter=adapters.AdapterConfig(activation='nope')),
     'Unknown MLP activation'),
    (dict(adapter=adapters.AdapterConfig(packed_form='blocks')),
     r"AdapterConfig.packed_form must be one of \('auto', 'task_blocks', "
     r"'pallas'\), got 'blocks'"),
    (dict(hyperformer=hyperformer.HyperFormerConfig(packed_form='kernel')),
     'HyperFormerConfig.packed_form must be one of'),
])
def test_bad_configuration_raises(change, message):
  cfg = dataclasses.replace(T5X_TINY_CONFIG, **change)
  with pytest.raises(ValueError, match=message):
    network.check_config(cfg)


@pytest.mark.parametrize('activation', ['relu', 'gelu'])
@pytest.mark.parametrize('with_norm', [False, True])
def test_adapt_groups_is_the_textbook_adapter(activation, with_norm):
  """`adapters.adapt_groups` writes its gradient out (the bottleneck also
  laid out [G, b, L]) and, for HyperFormer++, takes the post norm's
  statistics from the bottleneck; value and gradients (x, W_down, b_down,
  W_up, b_up and the norm's scale and bias) must be those of the textbook
  `norm(act(x W_down + b_down) W_up + b_up)` under autodiff. Group 2's row
  1 of x is zero and its b_down negative, so that row's bottleneck is zero
  under relu; with its b_up constant over d, the norm's variance there is
  exactly 0 (epsilon alone)."""
  rng = np.random.default_rng(3)
  groups, length, b, d = 3, 5, 4, 16
  x = rng.normal(size=(groups, length, d))
  x[2, 1] = 0.0
  down = rng.normal(0.0, 0.4, (groups, b, d))
  down_bias = rng.normal(0.0, 0.3, (groups, b))
  down_bias[2] = -np.abs(down_bias[2]) - 0.1
  up = rng.normal(0.0, 0.3, (groups, b, d))
  up_bias = rng.normal(0.7, 0.5, (groups, d))
  up_bias[2] = 0.4
  scale = rng.normal(1.0, 0.2, (groups, d))
  bias = rng.normal(0.0, 0.1, (groups, d))
  f32 = [jnp.asarray(a, jnp.float32)
         for a in (x, down, down_bias, up, up_bias, scale, bias)]
  args, norm = f32[:5], tuple(f32[5:]) if with_norm else None
  act = layers.activation(activation)
  weights = jnp.asarray(rng.normal(size=(groups, length, d)), jnp.float32)

  def textbook(x, down, down_bias, up, up_bias, norm):
    z = act(jnp.einsum('gld,gbd->glb', x, down, precision='highest')
            + down_bias[:, None])
    o = (jnp.einsum('glb,gbd->gld', z, up, precision='highest')
         + up_bias[:, None])
    if norm is None:
      return o
    mean = o.mean(-1, keepdims=True)
    var = ((o - mean) ** 2).mean(-1, keepdims=True)
    return ((o - mean) / jnp.sqrt(var + 1e-6) * norm[0][:, None]
            + norm[1][:, None])

  def ours(*a):
    return adapters.adapt_groups(act, *a)

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)) * weights)

  # The reductions: down (d), up (b), the norm's mean and variance (d, d);
  # the gradient takes them twice, then sums over the rows (length). The
  # norm divides a row's rounding (relative to max|o|) by its deviation
  # sqrt(var + eps): a row of small variance scales it up by max|o| / that.
  forward = [d, b] + [d, d] * bool(norm)
  o = np.einsum('glb,gbd->gld', act(np.einsum('gld,gbd->glb', x, down)
                                    + down_bias[:, None]), up) + up_bias[
                                        :, None]
  if norm:
    spread = np.sqrt(o.var(-1, keepdims=True) + 1e-6)
    size = np.abs(o).max(-1, keepdims=True) / spread * np.abs(
        scale[:, None]).max(-1, keepdims=True)
    # The gradient's rounding, relative to its largest entry, by as much
    # as the worst row's over the typical one's.
    gain = size.max() / (np.abs(o - o.mean(-1, keepdims=True)) / spread
                         * np.abs(scale[:, None])).max()
  else:
    size, gain = np.abs(o).max(), 1.0
  want = textbook(*args, norm)
  conftest.assert_close_to_scale(ours(*args, norm), want,
                                 conftest.float32_bound(*forward), size)
  got = jax.grad(loss(ours), range(6))(*args, norm)
  want = jax.grad(loss(textbook), range(6))(*args, norm)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.shape == w.shape
    conftest.assert_close_to_scale(g, w, gain * conftest.float32_bound(
        *forward * 2, length))


@pytest.mark.parametrize('with_norm', [False, True])
def test_on_chip_adapter_keeps_its_input_and_down_projection(with_norm,
                                                             capsys):
  """On packed rows on TPU (`adapters.adapt_on_chip`), the backward pass
  keeps of the tokens the adapter's input and the down projection's
  `[batch, length, b]` only: no bottleneck `[.., b + 1]`, float32
  pre-activations or variances (each of b columns fills a TPU's 128
  lanes); the rest it keeps is the weights the kernels take, `[T, ...]`."""
  rng = np.random.default_rng(4)
  t, d, b = 3, 16, 4
  arrays = [rng.normal(size=shape).astype(np.float32) for shape in
            ((t, d, b), (t, b), (t, b, d), (t, d), (t, d), (t, d))]
  w = adapters.AdapterWeights(*map(jnp.asarray, arrays))
  if not with_norm:
    w = w.replace(norm_scale=None, norm_bias=None)
  h = jnp.asarray(rng.normal(size=(2, 16, d)), jnp.bfloat16)
  task_ids = jnp.asarray([[0] * 5 + [2] * 7 + [1] * 4, [1] * 16])

  def loss(h, w):
    return jnp.sum(adapters.adapt_on_chip(jax.nn.relu, h, w, task_ids)
                   .astype(jnp.float32))

  jax.ad_checkpoint.print_saved_residuals(loss, h, w)
  kept = [line for line in capsys.readouterr().out.splitlines()
          if line and 'from the argument' not in line
          and 'from a constant' not in line]
  tokens = [line for line in kept if re.match(r'\w+\[2,16\b', line)]
  assert len(tokens) == 1 and tokens[0].startswith(
      "bf16[2,16,4] named 'adapter_down_projection'"), kept
  assert all(re.match(rf'\w+\[({t},|\])', line) for line in kept
             if line not in tokens), kept


def test_adapter_weights_per_layer_are_the_layers_slices():
  """`adapters.per_layer` gives layer m's `[T, ...]` arrays of every kind,
  and its gradient is one concatenate of the layers' (no zero-padded
  `[M, T, ...]` array a layer: XLA adds those inside every optimizer
  fusion that reads the gradient)."""
  rng = np.random.default_rng(3)
  m, t, d, b = 3, 2, 4, 2
  arrays = {name: rng.normal(size=(m, t) + shape).astype(np.float32)
            for name, shape in (('down', (d, b)), ('down_bias', (b,)),
                                ('up', (b, d)), ('up_bias', (d,)))}
  weights = {kind: adapters.AdapterWeights(
      **{name: jnp.asarray(a) * (i + 1) for name, a in arrays.items()})
             for i, kind in enumerate(adapters.KINDS)}
  layers = adapters.per_layer(weights)
  assert len(layers) == m
  for layer in range(m):
    for i, kind in enumerate(adapters.KINDS):
      assert layers[layer][kind].norm_scale is None
      for name, a in arrays.items():
        np.testing.assert_array_equal(
            getattr(layers[layer][kind], name), a[layer] * (i + 1))

  scale = np.arange(1, m + 1, dtype=np.float32)

  def loss(down):
    parts = adapters.unstack(down)
    return sum(s * jnp.sum(jnp.square(p)) for s, p in zip(scale, parts))

  down = jnp.asarray(arrays['down'])
  want = 2 * scale[:, None, None, None] * arrays['down']
  # Per entry: one product rounded in each, in float32.
  conftest.assert_close_to_scale(jax.grad(loss)(down), want,
                                 conftest.float32_bound(1), np.abs(want))
  primitives = {e.primitive.name
                for e in jax.make_jaxpr(jax.grad(loss))(down).jaxpr.eqns}
  assert 'concatenate' in primitives and 'pad' not in primitives


def test_adapter_task_gather_gradient_is_the_gathers():
  """Each group's weights are gathered from `[T, ...]` with a gradient
  written as a one-hot product; it must equal the scatter-add of plain
  indexing (tasks repeated and one task absent)."""
  rng = np.random.default_rng(2)
  table = jnp.asarray(rng.normal(size=(4, 3, 2)), jnp.float32)
  tasks = jnp.asarray([2, 0, 2, 2, 1], jnp.int32)
  weights = jnp.asarray(rng.normal(size=(5, 3, 2)), jnp.float32)

  def loss(take):
    return lambda a: jnp.sum(jnp.sin(take(a)) * weights)

  want = jax.grad(loss(lambda a: a[tasks]))(table)
  # Per entry: a sum over the batch's rows of the entry's task, relative to
  # the sum of its terms' magnitudes.
  size = np.zeros(table.shape)
  np.add.at(size, np.asarray(tasks), np.abs(
      np.cos(np.asarray(table)[np.asarray(tasks)]) * np.asarray(weights)))
  conftest.assert_close_to_scale(
      jax.grad(loss(lambda a: task_blocks.take_tasks(a, tasks)))(table),
      want, conftest.float32_bound(len(tasks)), size)
