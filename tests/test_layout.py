"""Parameter layout against t5x's T5.1.1 layout, written from the published
dimensions, and parameter totals against a hand-derived formula."""

import contextlib
import io
import json
import pathlib

import gin
import numpy as np
import pytest

from hyperprompt_jax import param_table
from hyperprompt_jax import paths

GIN_MODELS = sorted(
    (pathlib.Path(paths.gin_dir()) / 'models').glob('*.gin')
)

# Published T5.1.1 dimensions: d_model, heads, head_dim, d_ff, layers/stack.
T5_1_1 = {
    'small': (512, 6, 64, 1024, 8),
    'base': (768, 12, 64, 2048, 12),
    'large': (1024, 16, 64, 2816, 24),
}
VOCAB = 32128


def _table(*gin_files, bindings=()):
  argv = [f'--gin_file={f}' for f in gin_files] + ['--json']
  argv += [f'--gin.{b}' for b in bindings]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert param_table.main(argv) == 0
  return json.loads(out.getvalue())


def _expected_t5_1_1_layout(d, heads, head_dim, d_ff, layers):
  """t5x's examples/t5 T5.1.1 parameter paths and shapes."""
  joined = heads * head_dim
  shapes = {
      'token_embedder/embedding': [VOCAB, d],
      'encoder/relpos_bias/rel_embedding': [heads, 32],
      'encoder/encoder_norm/scale': [d],
      'decoder/relpos_bias/rel_embedding': [heads, 32],
      'decoder/decoder_norm/scale': [d],
      'decoder/logits_dense/kernel': [d, VOCAB],
  }
  mlp = {'mlp/wi_0/kernel': [d, d_ff], 'mlp/wi_1/kernel': [d, d_ff],
         'mlp/wo/kernel': [d_ff, d]}
  attn = lambda name: {f'{name}/query/kernel': [d, joined],
                       f'{name}/key/kernel': [d, joined],
                       f'{name}/value/kernel': [d, joined],
                       f'{name}/out/kernel': [joined, d]}
  for i in range(layers):
    enc = {**attn('attention'), **mlp, 'pre_attention_layer_norm/scale': [d],
           'pre_mlp_layer_norm/scale': [d]}
    dec = {**attn('self_attention'), **attn('encoder_decoder_attention'),
           **mlp, 'pre_self_attention_layer_norm/scale': [d],
           'pre_cross_attention_layer_norm/scale': [d],
           'pre_mlp_layer_norm/scale': [d]}
    shapes.update({f'encoder/layers_{i}/{k}': v for k, v in enc.items()})
    shapes.update({f'decoder/layers_{i}/{k}': v for k, v in dec.items()})
  return shapes


def test_t5_1_1_small_has_t5x_paths_and_shapes():
  got = _table('models/t5_1_1_small.gin')['parameters']
  # heads * head_dim = 384 != d_model = 512 in T5.1.1-small.
  assert got == _expected_t5_1_1_layout(*T5_1_1['small'])


@pytest.mark.parametrize('size', sorted(T5_1_1))
def test_totals_equal_the_formula(size):
  d, h, dh, f, n = T5_1_1[size]
  per_encoder_layer = 4 * d * h * dh + 3 * d * f + 2 * d
  per_decoder_layer = 8 * d * h * dh + 3 * d * f + 3 * d
  total = (2 * VOCAB * d                     # embedding + untied logits
           + n * (per_encoder_layer + per_decoder_layer)
           + 2 * d                           # final norms
           + 2 * 32 * h)                     # relative-position tables
  summary = _table(f'models/t5_1_1_{size}.gin')
  assert summary['total_parameters'] == total
  assert summary['backbone_parameters'] == total
  assert summary['task_conditioned_parameters'] == 0
  assert summary['ratio'] == 1.0


# The usual names of these models, in millions of parameters, and the
# digits they are rounded to (`round`'s): 77M / 248M / 783M / 2.85B /
# 11.1B; T5 v1.0 (tied logits, Base's d_ff 3072) Base 223M, and Large / 3B /
# 11B (HyperGrid's larger models), which the T5 paper's "770M", "3B", "11B"
# name loosely: the tied-logits counts are these. Checked by
# `test_param_table_json_for_every_model_gin`, one model a test.
PUBLISHED_MILLIONS = {
    't5_1_1_small': (77, 0), 't5_1_1_base': (248, 0),
    't5_1_1_large': (783, 0), 't5_1_1_xl': (2850, -1),
    't5_1_1_xxl': (11100, -2), 't5_base': (223, 0), 't5_large': (738, 0),
    't5_3b': (2850, -1), 't5_11b': (11300, -2),
}


def test_published_sizes_are_gin_models():
  """Every published size is checked: its model has a gin file."""
  assert set(PUBLISHED_MILLIONS) <= {f.stem for f in GIN_MODELS}


# T5 v1.0 (t5x/examples/t5/t5_1_0/*.gin): d_model, heads, head_dim, d_ff,
# layers per stack; ReLU, logits through the embedding.
T5_1_0 = {
    'base': (768, 12, 64, 3072, 12),
    'large': (1024, 16, 64, 4096, 24),
    '3b': (1024, 32, 128, 16384, 24),
    '11b': (1024, 128, 128, 65536, 24),
}


@pytest.mark.parametrize('size', sorted(T5_1_0))
def test_t5_1_0_models_have_the_published_dimensions(size):
  d, heads, head_dim, d_ff, layers = T5_1_0[size]
  gin.clear_config()
  try:
    from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
    from hyperprompt_jax.model import network  # pylint: disable=g-import-not-at-top
    gin_utils.parse_gin([f'models/t5_{size}.gin'], [])
    cfg = gin.get_configurable(network.Transformer)().config
  finally:
    gin.clear_config()
  assert (cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim,
          cfg.num_encoder_layers, cfg.num_decoder_layers) == (
              d, heads, head_dim, d_ff, layers, layers)
  assert tuple(cfg.mlp_activations) == ('relu',)
  assert cfg.logits_via_embedding and cfg.vocab_size == VOCAB


@pytest.mark.parametrize('gin_file', GIN_MODELS, ids=lambda p: p.stem)
def test_param_table_json_for_every_model_gin(gin_file):
  summary = _table(str(gin_file))
  assert set(summary) == {'total_parameters', 'backbone_parameters',
                          'task_conditioned_parameters', 'ratio',
                          'parameters'}
  sizes = [int(np.prod(s)) for s in summary['parameters'].values()]
  assert sum(sizes) == summary['total_parameters']
  assert all(not k.startswith('params/') for k in summary['parameters'])
  if gin_file.stem in PUBLISHED_MILLIONS:
    millions, digits = PUBLISHED_MILLIONS[gin_file.stem]
    assert round(summary['total_parameters'] / 1e6, digits) == millions


def test_tiny_dims_shard_on_a_2x4_mesh():
  shapes = _table('models/t5_1_1_tiny.gin')['parameters']
  for path, shape in shapes.items():
    assert all(dim % 4 == 0 for dim in shape), (path, shape)


def test_human_table_groups_modules(capsys):
  assert param_table.main(['--gin_file=models/t5_1_1_tiny.gin']) == 0
  out = capsys.readouterr().out
  assert 'encoder/layers_*/attention' in out
  assert 'ratio total/backbone' in out and '1.0000x' in out


def test_gin_macro_override_changes_the_model():
  small = _table('models/t5_1_1_tiny.gin')['total_parameters']
  bigger = _table('models/t5_1_1_tiny.gin',
                  bindings=['network.T5Config.num_encoder_layers=3'])
  assert bigger['total_parameters'] > small


@pytest.mark.parametrize('argv, message', [
    (['--gin_file=models/t5_1_1_tiny.gin',
      '--gin.network.T5Config.emb_dimm=3'], "parameter named 'emb_dimm'"),
    (['--gin_file=models/t5_1_1_tny.gin'], "Gin file 'models/t5_1_1_tny.gin' "
                                           'not found'),
    (['--gin_file=models/t5_1_1_tiny.gin', '--gin.NUM_TASKZ=3'], 'NUM_TASKZ'),
    ([], 'No --gin_file given'),
])
def test_gin_mistakes_raise_clear_errors(argv, message):
  with pytest.raises(ValueError, match=message):
    param_table.main(argv + ['--json'])
  gin.clear_config()
