"""HyperGrid and Output Gating against an independent numpy re-derivation."""

import contextlib
import dataclasses
import io
import json
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import multiprocess
import numpy_hypergrid
import numpy_t5
from conftest import T5X_TINY_CONFIG, decode_with_cache, decoder_inputs
from conftest import flat, random_tokens
from hyperprompt_jax import param_table
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.model import network

TASKS = 3


def _config(**hg):
  hg = dict(dict(variant='lg', grid_rows=4, grid_cols=8), **hg)
  return dataclasses.replace(T5X_TINY_CONFIG, num_tasks=TASKS,
                             hypergrid=hypergrid.HyperGridConfig(**hg))


def _bound(cfg, inputs, targets):
  """float32 rounding of the forward pass at these lengths
  (`conftest.float32_bound`), relative to the output's largest entry: the
  network's reductions (the task vector one more key) and each layer's
  gate (the task vector's attention, the projection to the grid)."""
  gate = [cfg.emb_dim, cfg.head_dim, inputs + 1,
          cfg.num_heads * cfg.head_dim, cfg.emb_dim]
  layers = cfg.num_encoder_layers + cfg.num_decoder_layers
  return conftest.float32_bound(
      *conftest.t5_forward_lengths(cfg, inputs + 1, targets), *gate * layers)


def _batch(seed=0, inputs=9):
  rng = np.random.default_rng(seed)
  enc = random_tokens(rng, (3, inputs), pad_from=[inputs, 5, 3])
  tgt = random_tokens(rng, (3, 5), pad_from=[5, 4, 2])
  dec_in = np.concatenate([np.zeros((3, 1), np.int32), tgt[:, :-1]], 1)
  return enc, np.where(tgt > 0, dec_in, 0), tgt, np.array([2, 0, 1],
                                                             np.int32)


def _init(cfg, seed=0):
  model = network.Transformer(cfg)
  enc, dec_in, tgt, ids = _batch()
  params = model.init(jax.random.PRNGKey(seed), enc, dec_in, tgt,
                      enable_dropout=False, task_ids=ids)['params']
  return model, params


def _reference(cfg, p, enc, dec_in, tgt, ids):
  gated = len(cfg.mlp_activations) == 2
  out = []
  for e, d, t, task in zip(enc, dec_in, tgt, ids):
    fn = numpy_hypergrid.gate_fn(p, cfg, task)
    encoded = numpy_t5.encode(p, e, cfg.num_heads, cfg.num_encoder_layers,
                              gated, gate_fn=fn)
    out.append(numpy_t5.decode(p, encoded, e, d, t, cfg.num_heads,
                               cfg.num_decoder_layers, gated, gate_fn=fn))
  return np.stack(out)


CASES = [
    dict(variant='l'),
    dict(variant='l2'),
    dict(variant='lg'),
    dict(variant='gl'),
    dict(variant='lg', target='wi'),
    dict(variant='l', target='wi'),
    dict(variant='l2', target='both', placement='encoder'),
    dict(variant='gl', placement='decoder'),
    dict(variant='lg', conditioning='first_token'),
    dict(variant='l2', scalar=True),
    dict(variant='l2', grid_rows=32, grid_cols=64),  # Max-Grid
    dict(variant='output_gating'),
    dict(variant='output_gating', output_gating_values=16,
         conditioning='first_token'),
]


@pytest.mark.parametrize('hg', CASES, ids=lambda hg: '-'.join(
    f'{v}' for v in hg.values()))
@pytest.mark.parametrize('inputs', [9, 5])  # fold / blockwise in the encoder
def test_matches_numpy_rederivation(hg, inputs):
  cfg = _config(**hg)
  model, params = _init(cfg)
  enc, dec_in, tgt, ids = _batch(inputs=inputs)
  logits = jax.jit(lambda p: model.apply(
      {'params': p}, enc, dec_in, tgt, enable_dropout=False,
      task_ids=ids))(params)
  p = flat(params)
  want = _reference(cfg, p, enc, dec_in, tgt, ids)
  valid = tgt > 0
  bound = _bound(cfg, inputs, 5)
  conftest.assert_close_to_scale(np.asarray(logits)[valid], want[valid],
                                 bound)
  plain = numpy_t5.decode(p, numpy_t5.encode(p, enc[0], 2, 2), enc[0],
                          dec_in[0], tgt[0], 2, 2)
  assert np.abs(plain - want[0]).max() > bound * np.abs(
      want[0]).max()  # the gates matter


def test_relu_t5_v1_0_output_gating_and_hypergrid():
  for hg in (dict(variant='output_gating'), dict(variant='lg')):
    cfg = dataclasses.replace(_config(**hg), mlp_activations=('relu',),
                              logits_via_embedding=True)
    model, params = _init(cfg)
    enc, dec_in, tgt, ids = _batch()
    logits = model.apply({'params': params}, enc, dec_in, tgt,
                         enable_dropout=False, task_ids=ids)
    p = flat(params)
    out = []
    for e, d, t, task in zip(enc, dec_in, tgt, ids):
      fn = numpy_hypergrid.gate_fn(p, cfg, task)
      encoded = numpy_t5.encode(p, e, 2, 2, gated=False, gate_fn=fn)
      out.append(numpy_t5.decode(p, encoded, e, d, t, 2, 2, gated=False,
                                 tied=True, gate_fn=fn))
    valid = tgt > 0
    conftest.assert_close_to_scale(np.asarray(logits)[valid],
                                   np.stack(out)[valid], _bound(cfg, 9, 5))


@pytest.mark.parametrize('length', [1, 3, 40])
def test_psi_is_a_block_repeat_on_both_routes(length):
  """Each grid value lands on its own weight block, for wo ([d_ff, d_model])
  and wi ([d_model, d_ff]) orientations, through the blockwise (short) and
  the folded (long) routes."""
  d_model, d_ff, rows, cols = 8, 12, 2, 3
  grid = (np.arange(rows * cols, dtype=np.float32).reshape(1, rows, cols)
          + 1) / 10  # one distinct value per block
  rng = np.random.default_rng(0)
  for rows_are_model, (d_in, d_out) in ((True, (d_model, d_ff)),
                                        (False, (d_ff, d_model))):
    kernel = rng.normal(size=(d_in, d_out)).astype(np.float32)
    x = rng.normal(size=(1, length, d_in)).astype(np.float32)
    oriented = hypergrid.orient_grid(jnp.asarray(grid), rows_are_model)
    gate = np.zeros((d_in, d_out))
    for i in range(d_in):
      for o in range(d_out):
        m, f = (i, o) if rows_are_model else (o, i)
        gate[i, o] = grid[0, m // (d_model // rows), f // (d_ff // cols)]
    want = x[0] @ ((1 + gate) * kernel)
    size = np.abs(x[0]) @ np.abs((1 + gate) * kernel)
    for route in (None, 'blockwise', 'fold'):  # the rule's pick, then both
      got = hypergrid.gated_matmul(jnp.asarray(x), jnp.asarray(kernel),
                                   oriented, route=route)
      # Per entry: the sum over d_in, the gate's sum and product.
      conftest.assert_close_to_scale(got[0], want, conftest.float32_bound(
          d_in, 2), size)
  assert hypergrid.gated_matmul_route(length, d_ff, cols, rows) == (
      'blockwise' if length * cols < d_ff else 'fold')


@pytest.mark.parametrize('d_in, d_out, k_in, k_out', [
    (16, 24, 8, 2),   # fewer gated input copies than partial sums
    (24, 16, 2, 8),   # fewer partial sums than gated input copies
])
def test_blockwise_route_on_either_side(d_in, d_out, k_in, k_out):
  """The blockwise route keeps the smaller intermediate (per-output-block
  gated inputs, or per-input-block partial sums); both are x ((1 + psi(G))
  ⊙ W), psi a block repeat."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 3, d_in)).astype(np.float32)
  kernel = rng.normal(size=(d_in, d_out)).astype(np.float32)
  grid = rng.uniform(size=(2, k_in, k_out)).astype(np.float32)
  for b in range(2):
    gate = np.array([[grid[b, i // (d_in // k_in), o // (d_out // k_out)]
                      for o in range(d_out)] for i in range(d_in)])
    want = x[b] @ ((1 + gate) * kernel)
    got = hypergrid.gated_matmul(jnp.asarray(x), jnp.asarray(kernel),
                                 jnp.asarray(grid), route='blockwise')[b]
    # Per entry: the sum over d_in, the gate's sum and product.
    conftest.assert_close_to_scale(
        got, want, conftest.float32_bound(d_in, 2),
        np.abs(x[b]) @ np.abs((1 + gate) * kernel))


def test_cached_decoding_equals_teacher_forcing_and_no_target_leak():
  cfg = _config(variant='l2')
  model, params = _init(cfg)
  enc, _, _, ids = _batch()
  tgt = random_tokens(np.random.default_rng(3), (3, 5))
  dec_in = decoder_inputs(tgt)
  full = model.apply({'params': params}, enc, dec_in, tgt,
                     enable_dropout=False, task_ids=ids)
  got, _ = decode_with_cache(model, params, enc, dec_in, ids)
  conftest.assert_close_to_scale(got, full, _bound(cfg, 9, 5))
  # A later target token cannot reach earlier positions, not even through
  # the (per-example) gate.
  changed = dec_in.copy()
  changed[:, 3] = changed[:, 3] % 383 + 1
  after = model.apply({'params': params}, enc, changed, tgt,
                      enable_dropout=False, task_ids=ids)
  # Exact: a masked score is -1e10 whatever the token, its weight exp() = 0.
  np.testing.assert_array_equal(after[:, :3], full[:, :3])


@pytest.mark.parametrize('hg, leaf, shape', [
    (dict(variant='lg', target='both'), ('hypergrid', 'cached_grid'),
     (3, 4, 8)),
    (dict(variant='output_gating', conditioning='first_token'),
     ('output_gating', 'cached_gate'), (3, 64)),
])
def test_decode_steps_read_the_decoder_gates_from_the_cache(hg, leaf, shape):
  """The gates depend only on `encoded` and the task: the cache holds them
  (batch-major, so beam search expands them), and a decode step runs with
  every decoder gate parameter removed, to the same logits."""
  cfg = _config(**hg)
  model, params = _init(cfg)
  enc, dec_in, _, ids = _batch()
  encoded = model.apply({'params': params}, enc, enable_dropout=False,
                        task_ids=ids, method=model.encode)
  cache = network.create_cache(model, params, encoded, enc, 5, ids)
  for i in range(cfg.num_decoder_layers):
    assert cache['decoder'][f'layers_{i}'][leaf[0]][leaf[1]].shape == shape
  every = flax.traverse_util.flatten_dict(params, sep='/')
  without_gates = {k: v for k, v in every.items()
                   if not (k.startswith('decoder/') and leaf[0] in k)}
  assert len(without_gates) < len(every)

  def step(p):
    token = dec_in[:, :1]
    return model.apply(
        {'params': p, 'cache': cache}, encoded, enc, token, token,
        enable_dropout=False, decode=True, max_decode_length=5, task_ids=ids,
        mutable=['cache'], method=model.decode)[0]

  unflat = flax.traverse_util.unflatten_dict(without_gates, sep='/')
  np.testing.assert_array_equal(step(unflat), step(params))


@pytest.mark.parametrize('hg, message', [
    (dict(grid_rows=5), 'GRID_ROWS=5 must be a positive divisor of '
                        'd_model=32'),
    (dict(grid_cols=7), 'GRID_COLS=7 must be a positive divisor of d_ff=64'),
    (dict(variant='lll'), 'variant must be one of'),
    (dict(conditioning='pooling'), 'HYPERGRID_CONDITIONING'),
    (dict(target='wq'), 'HYPERGRID_TARGET'),
    (dict(variant='output_gating', output_gating_values=5),
     'output_gating_values=5'),
    (dict(max_segments=0), 'MAX_SEGMENTS=0'),
    (dict(packed_form='sorted'), 'packed_form'),
])
def test_bad_configuration_raises(hg, message):
  with pytest.raises(ValueError, match=message):
    _init(_config(**hg))


def test_the_old_packed_form_name_still_works_with_a_warning():
  """'token_blocks' is 'blockwise' ('task_blocks' is another
  form): `HyperGridConfig.packed_form` takes the old name for one release,
  warning with the new, and computes what the new one does."""
  assert 'blockwise' in hypergrid.PACKED_FORMS
  assert 'token_blocks' not in hypergrid.PACKED_FORMS
  old = hypergrid.HyperGridConfig(packed_form='token_blocks')
  with pytest.warns(DeprecationWarning,
                    match="'token_blocks' is now 'blockwise'"):
    hypergrid.check_hypergrid_config(old, 64, 256)
  with pytest.warns(DeprecationWarning, match="'blockwise'"):
    assert hypergrid.resolve_packed_form('token_blocks') == 'blockwise'
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 6, 8)).astype(np.float32)
  kernel = rng.normal(size=(8, 12)).astype(np.float32)
  grid = rng.uniform(size=(2, 2, 4, 6)).astype(np.float32)
  segments = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 2, 2, 2]], np.int32)
  with pytest.warns(DeprecationWarning, match="'blockwise'"):
    got = hypergrid.packed_gated_matmul(x, kernel, grid, segments,
                                        form='token_blocks')
  np.testing.assert_array_equal(got, hypergrid.packed_gated_matmul(
      x, kernel, grid, segments, form='blockwise'))


def test_bad_inputs_raise():
  model, params = _init(_config())
  enc, dec_in, tgt, ids = _batch()
  with pytest.raises(ValueError, match='HyperGrid needs task_ids'):
    model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False)
  with pytest.raises(ValueError, match='per-token task ids'):
    model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False,
                task_ids=ids, encoder_segment_ids=np.ones_like(enc),
                decoder_segment_ids=np.ones_like(tgt))


def _summary(model, variant, *bindings):
  argv = [f'--gin_file=models/{model}.gin',
          f'--gin_file=variants/{variant}.gin', '--json',
          '--gin.network.T5Config.num_tasks=16']  # GLUE + SuperGLUE
  argv += [f'--gin.{b}' for b in bindings]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table.main(argv) == 0
  return json.loads(out.getvalue())


@pytest.mark.parametrize('model, d, f', [('t5_base', 768, 3072),
                                         ('t5_1_1_base', 768, 2048)])
def test_parameter_counts_and_ratios(model, d, f):
  layers, tasks, d_r, d_c = 24, 16, 32, 128  # 12 + 12 layers, GLUE+SuperGLUE
  per_layer = {
      'hypergrid_l': d * d_r,
      'hypergrid_l2': d * d_r + d * d_c,
      'hypergrid_lg': d * d_r + d_c,
      'hypergrid_gl': d_r + d * d_c,
      'output_gating': d * f,
  }
  for variant, n in per_layer.items():
    summary = _summary(model, variant)
    assert summary['task_conditioned_parameters'] == (
        layers * n + 2 * tasks * d), variant
    print(f'{model} {variant}: {summary["ratio"]:.4f}x')
    if variant != 'output_gating':  # full-size OG is exempt
      assert summary['ratio'] < 1.02
  og16 = _summary(model, 'output_gating', 'OUTPUT_GATING_VALUES=16')
  assert og16['task_conditioned_parameters'] == layers * d * 16 + 2 * tasks * d
  max_grid = _summary(model, 'hypergrid_l2', f'GRID_ROWS={d}',
                      f'GRID_COLS={f}')
  print(f'{model} max-grid L2: {max_grid["ratio"]:.4f}x')


# The per-shard forms on a mesh of 4 x 2 CPU devices, in a process of its own
# (the device count is fixed when JAX starts).
_PER_SHARD_FORM_ON_A_MESH = '''
import json
import jax, numpy as np
from flax.linen import partitioning as nn_partitioning
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.tpu import program_figures
rng = np.random.default_rng(0)
rows, length, d_in, d_out, s, k_in, k_out = 8, 32, 8, 12, 3, 4, 6
x = rng.normal(size=(rows, length, d_in)).astype(np.float32)
kernel = rng.normal(size=(d_in, d_out)).astype(np.float32)
grid = rng.uniform(size=(rows, s, k_in, k_out)).astype(np.float32)
w = rng.normal(size=(rows, length, d_out)).astype(np.float32)
segments = np.zeros((rows, length), np.int32)
for r in range(rows):  # contiguous examples in order, padding last
  sizes = rng.multinomial(length, [0.25] * 4)
  segments[r] = np.repeat([1, 2, 3, 0], sizes)

def loss(x, kernel):
  return (hypergrid.packed_gated_matmul(x, kernel, grid, segments, form=FORM,
                                        kernel_axes=('mlp', 'embed')) * w).sum()

mesh = partitioning.create_mesh(data=4, model=2)
rows_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
with jax.set_mesh(mesh), nn_partitioning.axis_rules(
    partitioning.logical_axis_rules()):
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)),
                 in_shardings=(rows_split, whole))
  compiled = step.lower(x, kernel).compile()
  value, (dx, dkernel) = compiled(x, kernel)
print('RESULT', json.dumps({
    'value': float(value), 'dx': np.asarray(dx).tolist(),
    'dkernel': np.asarray(dkernel).tolist(),
    'collective_bytes': sum(c['bytes'] for c in program_figures.hlo_summary(
        compiled.as_text())['collectives'].values()),
    'segments': segments.tolist(), 'x': x.tolist(), 'kernel': kernel.tolist(),
    'grid': grid.tolist(), 'w': w.tolist()}))
'''


@pytest.mark.parametrize('form', ['grouped', 'pallas'])
def test_per_shard_forms_keep_each_row_on_its_data_shard(form):
  """HyperGrid's grouped form and its TPU kernel (run by Pallas's
  interpreter here) with the batch split over 'data': the value and
  gradients of `sum(w * out)` are numpy's token-by-token gated matmul
  (HyperGrid Eq. 5 per segment), and no row crosses the mesh: the
  program's collectives move at most one data shard's outputs and the
  kernel (the kernel's gradient and the loss are summed; the pallas form
  splits the kernel's rows over 'model', as its logical axes say, and sums
  the partial outputs, as XLA sums a split matmul's; one ragged matmul
  over the whole batch moves every row to every device: 16x the grouped
  form's bytes here)."""
  program = f'FORM = {form!r}\n' + _PER_SHARD_FORM_ON_A_MESH
  run = subprocess.run([sys.executable, '-c', program],
                       env=multiprocess.env(8), capture_output=True,
                       text=True, timeout=600)
  lines = [l for l in run.stdout.splitlines() if l.startswith('RESULT ')]
  assert lines, run.stderr[-3000:]
  r = {k: np.asarray(v) for k, v in json.loads(lines[0][7:]).items()}
  x, kernel, w = r['x'], r['kernel'], r['w']
  rows, length, d_in = x.shape
  d_out = kernel.shape[1]
  shard_outputs = rows // 4 * length * d_out * 4  # float32
  assert r['collective_bytes'] <= shard_outputs + kernel.nbytes + 64
  # The reference, and the sums of magnitudes its rounding scales with.
  value = value_size = 0.0
  dx, dx_size = np.zeros_like(x), np.zeros_like(x)
  dkernel, dkernel_size = np.zeros_like(kernel), np.zeros_like(kernel)
  for row in range(rows):
    for t in range(length):
      s = r['segments'][row, t]
      gate = 1 if s == 0 else 1 + numpy_hypergrid.block_repeat(
          r['grid'][row, s - 1], d_in, d_out)
      gated = kernel * gate
      value += x[row, t] @ gated @ w[row, t]
      value_size += np.abs(x[row, t]) @ np.abs(gated) @ np.abs(w[row, t])
      dx[row, t] = gated @ w[row, t]
      dx_size[row, t] = np.abs(gated) @ np.abs(w[row, t])
      dkernel += np.outer(x[row, t], w[row, t]) * gate
      dkernel_size += np.abs(np.outer(x[row, t], w[row, t])) * gate
  tokens = rows * length
  assert abs(r['value'] - value) <= conftest.float32_bound(
      d_in, d_out, tokens) * value_size
  assert (np.abs(r['dx'] - dx)
          <= conftest.float32_bound(d_out, d_out) * dx_size).all()
  assert (np.abs(r['dkernel'] - dkernel)
          <= conftest.float32_bound(tokens, tokens) * dkernel_size).all()



def test_grouped_form_over_several_ragged_matmuls(monkeypatch):
  """The grouped form takes a batch's rows a few at a time, one ragged
  matmul of at most `MAX_RAGGED_GROUPS` groups each (the TPU compiler fails
  on some larger counts): split into 2 + 2 + 1 rows here, its value and
  gradients of `sum(w * out)` are still each token's own example's gated
  matmul (numpy, Eq. 7 per segment)."""
  monkeypatch.setattr(hypergrid, 'MAX_RAGGED_GROUPS', 8)  # 4 groups a row
  rng = np.random.default_rng(0)
  rows, length, d_in, d_out, s, k_in, k_out = 5, 12, 8, 12, 3, 4, 6
  x = rng.normal(size=(rows, length, d_in)).astype(np.float32)
  kernel = rng.normal(size=(d_in, d_out)).astype(np.float32)
  grid = rng.uniform(size=(rows, s, k_in, k_out)).astype(np.float32)
  w = rng.normal(size=(rows, length, d_out)).astype(np.float32)
  segments = np.stack([np.repeat([1, 2, 3, 0], rng.multinomial(
      length, [0.25] * 4)) for _ in range(rows)]).astype(np.int32)

  def loss(x, kernel):
    return (hypergrid.packed_gated_matmul(x, kernel, grid, segments,
                                          form='grouped') * w).sum()

  value, (dx, dkernel) = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, kernel)
  want = size = 0.0
  dx_want, dkernel_want = np.zeros_like(x), np.zeros_like(kernel)
  for row in range(rows):
    for t in range(length):
      seg = segments[row, t]
      gate = 1 if seg == 0 else 1 + numpy_hypergrid.block_repeat(
          grid[row, seg - 1], d_in, d_out)
      want += x[row, t] @ (kernel * gate) @ w[row, t]
      size += np.abs(x[row, t]) @ np.abs(kernel * gate) @ np.abs(w[row, t])
      dx_want[row, t] = (kernel * gate) @ w[row, t]
      dkernel_want += np.outer(x[row, t], w[row, t]) * gate
  bound = conftest.float32_bound(d_in, d_out, rows * length)
  conftest.assert_close_to_scale(value, want, bound, size)
  conftest.assert_close_to_scale(dx, dx_want, bound, name='dx')
  conftest.assert_close_to_scale(dkernel, dkernel_want, bound, name='dkernel')
