"""Hugging Face T5 checkpoints in and out (`hyperprompt_jax.huggingface`,
`python -m hyperprompt_jax.convert`), without PyTorch or transformers.

transformers' tensors are written here with numpy and safetensors, their
names listed by hand from transformers' `modeling_t5.py` (not from the
project's table); the project's side is the network's own parameter tree and
the project's checkpoint reader. transformers' own T5 is the reference of
tests/test_transformers_reference.py.
"""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

from flax import traverse_util
import jax
import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

import conftest
import task_separation as ts
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import initial_checkpoint
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.huggingface import conversion
from hyperprompt_jax.huggingface import model_config
from hyperprompt_jax.huggingface import weight_names
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer as trainer_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A tiny Flan-T5 / T5.1.1-shaped config.json (gated GELU, untied lm_head).
T5_1_1 = {'architectures': ['T5ForConditionalGeneration'], 'model_type': 't5',
          'vocab_size': 64, 'd_model': 32, 'd_kv': 16, 'num_heads': 2,
          'd_ff': 128, 'num_layers': 2, 'num_decoder_layers': 2,
          'feed_forward_proj': 'gated-gelu', 'tie_word_embeddings': False,
          'dropout_rate': 0.1, 'layer_norm_epsilon': 1e-6,
          'relative_attention_num_buckets': 32,
          'relative_attention_max_distance': 128, 'is_encoder_decoder': True,
          'pad_token_id': 0, 'eos_token_id': 1, 'decoder_start_token_id': 0}
# T5 v1.0 (t5-small's config.json fields): ReLU, tied, no
# num_decoder_layers and no tie_word_embeddings (transformers' defaults).
T5_1_0 = {k: v for k, v in T5_1_1.items()
          if k not in ('num_decoder_layers', 'tie_word_embeddings')} | {
              'feed_forward_proj': 'relu'}
# mT5: its own model_type and a vocabulary of SentencePiece + sentinels +
# padding; here with stacks of different depths too.
MT5 = T5_1_1 | {'model_type': 'mt5', 'architectures':
                ['MT5ForConditionalGeneration'], 'vocab_size': 250,
                'num_decoder_layers': 3}


def _hf_shapes(config) -> dict[str, tuple[int, ...]]:
  """transformers' T5ForConditionalGeneration tensors (nn.Linear weights
  [out, in], nn.Embedding [num, dim]), listed from its modules."""
  d, ff, vocab = config['d_model'], config['d_ff'], config['vocab_size']
  joined = config['num_heads'] * config['d_kv']
  gated = config['feed_forward_proj'].startswith('gated')
  shapes = {'shared.weight': (vocab, d),
            'encoder.final_layer_norm.weight': (d,),
            'decoder.final_layer_norm.weight': (d,)}
  if config.get('tie_word_embeddings', True) is False:
    shapes['lm_head.weight'] = (vocab, d)
  attention = {'q.weight': (joined, d), 'k.weight': (joined, d),
               'v.weight': (joined, d), 'o.weight': (d, joined)}
  ffn = ({'wi_0.weight': (ff, d), 'wi_1.weight': (ff, d)} if gated
         else {'wi.weight': (ff, d)}) | {'wo.weight': (d, ff)}
  stacks = (('encoder', config['num_layers'], ('SelfAttention',)),
            ('decoder', config.get('num_decoder_layers') or
             config['num_layers'], ('SelfAttention', 'EncDecAttention')))
  for stack, layers, blocks in stacks:
    shapes[f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.'
           'weight'] = (32, config['num_heads'])
    for i in range(layers):
      for k, block in enumerate(blocks):
        for name, shape in attention.items():
          shapes[f'{stack}.block.{i}.layer.{k}.{block}.{name}'] = shape
        shapes[f'{stack}.block.{i}.layer.{k}.layer_norm.weight'] = (d,)
      k = len(blocks)
      shapes[f'{stack}.block.{i}.layer.{k}.layer_norm.weight'] = (d,)
      for name, shape in ffn.items():
        shapes[f'{stack}.block.{i}.layer.{k}.DenseReluDense.{name}'] = shape
  return shapes


def _hf_dir(path: pathlib.Path, config, seed=0, extra=None, drop=(),
            shards=1, dtype=np.float32) -> tuple[pathlib.Path, dict]:
  """A transformers directory of random tensors: config.json and
  model.safetensors (or `shards` files and their index)."""
  rng = np.random.default_rng(seed)
  tensors = {k: rng.standard_normal(s).astype(dtype)
             for k, s in _hf_shapes(config).items() if k not in drop}
  tensors.update(extra or {})
  path.mkdir(parents=True, exist_ok=True)
  (path / 'config.json').write_text(json.dumps(config))
  if shards == 1:
    safetensors_numpy.save_file(tensors, path / 'model.safetensors',
                                metadata={'format': 'pt'})
  else:
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
      file = f'model-{s + 1:05d}-of-{shards:05d}.safetensors'
      part = {k: tensors[k] for k in names[s::shards]}
      safetensors_numpy.save_file(part, path / file)
      weight_map.update({k: file for k in part})
    (path / 'model.safetensors.index.json').write_text(
        json.dumps({'metadata': {}, 'weight_map': weight_map}))
  return path, tensors


# The same parameter read by hand from transformers' modules: t5x kernels
# [in, out] are the transposes of nn.Linear weights; the relative-position
# table [heads, buckets] of nn.Embedding [buckets, heads]; norms as they are.
def _expected(config, tensors) -> dict[str, np.ndarray]:
  t = lambda k: tensors[k].astype(np.float32).T
  same = lambda k: tensors[k].astype(np.float32)
  out = {'token_embedder/embedding': same('shared.weight'),
         'encoder/encoder_norm/scale': same('encoder.final_layer_norm.weight'),
         'decoder/decoder_norm/scale': same('decoder.final_layer_norm.weight')}
  if config.get('tie_word_embeddings', True) is False:
    out['decoder/logits_dense/kernel'] = t('lm_head.weight')
  for stack in ('encoder', 'decoder'):
    out[f'{stack}/relpos_bias/rel_embedding'] = t(
        f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.'
        'weight')
  out['encoder/layers_1/attention/query/kernel'] = t(
      'encoder.block.1.layer.0.SelfAttention.q.weight')
  out['encoder/layers_0/attention/out/kernel'] = t(
      'encoder.block.0.layer.0.SelfAttention.o.weight')
  out['encoder/layers_1/pre_mlp_layer_norm/scale'] = same(
      'encoder.block.1.layer.1.layer_norm.weight')
  out['decoder/layers_1/encoder_decoder_attention/value/kernel'] = t(
      'decoder.block.1.layer.1.EncDecAttention.v.weight')
  out['decoder/layers_0/pre_cross_attention_layer_norm/scale'] = same(
      'decoder.block.0.layer.1.layer_norm.weight')
  out['decoder/layers_1/pre_mlp_layer_norm/scale'] = same(
      'decoder.block.1.layer.2.layer_norm.weight')
  if config['feed_forward_proj'].startswith('gated'):
    out['decoder/layers_0/mlp/wi_1/kernel'] = t(
        'decoder.block.0.layer.2.DenseReluDense.wi_1.weight')
  else:
    out['decoder/layers_0/mlp/wi/kernel'] = t(
        'decoder.block.0.layer.2.DenseReluDense.wi.weight')
  out['encoder/layers_0/mlp/wo/kernel'] = t(
      'encoder.block.0.layer.1.DenseReluDense.wo.weight')
  return out


def _model_params(cfg) -> dict[str, tuple[int, ...]]:
  abstract = network.abstract_variables(network.Transformer(cfg))['params']
  return {k: tuple(v.shape)
          for k, v in traverse_util.flatten_dict(abstract, sep='/').items()}


@pytest.mark.parametrize('config', [T5_1_1, T5_1_0, MT5],
                         ids=['t5_1_1', 't5_1_0', 'mt5'])
def test_from_hf_gives_the_networks_parameters(config, tmp_path):
  """The checkpoint the project's reader reads has exactly the network's
  parameter paths and shapes, each value transformers' tensor laid out as
  t5x lays it out."""
  hf, tensors = _hf_dir(tmp_path / 'hf', config, shards=2 if config is MT5
                        else 1)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  assert out.checkpoint == str(tmp_path / 'out' / 'checkpoint_0')
  loaded = checkpoints.load_t5x_params(out.checkpoint)
  assert {k: v.shape for k, v in loaded.items()} == _model_params(out.config)
  assert all(v.dtype == np.float32 for v in loaded.values())
  expected = _expected(config, tensors)
  for k, v in expected.items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)
  tied = config is T5_1_0
  assert ('decoder/logits_dense/kernel' in loaded) is not tied


def test_config_mapping():
  cfg = model_config.from_hf(T5_1_1)
  assert (cfg.vocab_size, cfg.emb_dim, cfg.num_heads, cfg.head_dim,
          cfg.mlp_dim, cfg.num_encoder_layers, cfg.num_decoder_layers) == (
              64, 32, 2, 16, 128, 2, 2)
  assert tuple(cfg.mlp_activations) == ('gelu', 'linear')
  assert not cfg.logits_via_embedding and cfg.dropout_rate == 0.1
  v1 = model_config.from_hf(T5_1_0)
  assert tuple(v1.mlp_activations) == ('relu',) and v1.logits_via_embedding
  assert v1.num_decoder_layers == 2
  mt5 = model_config.from_hf(MT5)
  assert (mt5.vocab_size, mt5.num_decoder_layers) == (250, 3)
  for proj, acts in (('gated-silu', ('silu', 'linear')), ('silu', ('silu',)),
                     ('gelu_new', ('gelu',)), ('gated-relu', ('relu',
                                                              'linear'))):
    assert model_config.activations(proj) == acts
  # Back to a config.json: the same network.
  for config in (T5_1_1, T5_1_0, MT5):
    again = model_config.to_hf(model_config.from_hf(config))
    for field in ('vocab_size', 'd_model', 'd_kv', 'num_heads', 'd_ff',
                  'num_layers', 'feed_forward_proj', 'dropout_rate',
                  'relative_attention_num_buckets',
                  'relative_attention_max_distance'):
      assert again[field] == config[field], field
    assert again['num_decoder_layers'] == config.get(
        'num_decoder_layers', config['num_layers'])
    assert again['tie_word_embeddings'] is (config is T5_1_0)


def test_the_gin_bindings_build_the_config_with_a_method(tmp_path):
  """model.gin, the printed bindings, parses with a method's variant file
  into the converted config (plus the method)."""
  hf, _ = _hf_dir(tmp_path / 'hf', T5_1_1)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  assert (tmp_path / 'out' / 'model.gin').read_text() == out.gin_text
  for variant, field in (('hyperprompt_global', 'hyperprompt'),
                         ('hypergrid_lg', 'hypergrid')):
    cfg = ts.build_config(variant, out.gin_file,
                          ['network.T5Config.num_tasks = 4'])
    for name in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim',
                 'mlp_dim', 'num_encoder_layers', 'num_decoder_layers',
                 'logits_via_embedding', 'dropout_rate'):
      assert getattr(cfg, name) == getattr(out.config, name), name
    assert tuple(cfg.mlp_activations) == ('gelu', 'linear')
    assert getattr(cfg, field) is not None


@pytest.mark.parametrize('change, message', [
    ({'model_type': 'bert'}, "model_type 'bert' is not T5"),
    ({'model_type': 'umt5'}, 'umT5 has a relative-position table per layer'),
    ({'is_encoder_decoder': False}, 'is_encoder_decoder is false'),
    ({'architectures': ['T5EncoderModel']}, 'an encoder alone'),
    ({'feed_forward_proj': 'gelu'}, "feed_forward_proj 'gelu' cannot be"),
    ({'feed_forward_proj': 'gated-tanh'}, "feed_forward_proj 'gated-tanh'"),
    ({'relative_attention_num_buckets': 64},
     'relative_attention_num_buckets is 64'),
    ({'relative_attention_max_distance': 256},
     'relative_attention_max_distance is 256'),
    ({'layer_norm_epsilon': 1e-5}, 'layer_norm_epsilon is 1e-05'),
    ({'pad_token_id': 3}, 'pad_token_id is 3'),
    ({'num_decoder_layers': 0}, 'num_decoder_layers is 0'),
    ({'d_model': None}, 'lacks d_model'),
])
def test_configs_the_network_cannot_represent_are_refused(change, message):
  config = {k: v for k, v in (T5_1_1 | change).items() if v is not None}
  with pytest.raises(ValueError, match=message):
    model_config.from_hf(config)


def test_to_hf_refuses_activations_transformers_lacks():
  cfg = model_config.from_hf(T5_1_1)
  with pytest.raises(ValueError, match='mlp_activations'):
    model_config.to_hf(dataclasses.replace(cfg, mlp_activations=(
        'gelu', 'gelu')))


Q0 = 'encoder.block.0.layer.0.SelfAttention.q.weight'


@pytest.mark.parametrize('kind', ['missing', 'extra', 'shape', 'wrong_ffn',
                                  'tied_copy', 'no_weights', 'no_config'])
def test_tensors_that_do_not_fit_are_named(kind, tmp_path):
  config, kwargs = T5_1_1, {}
  if kind == 'missing':
    kwargs, message = {'drop': (Q0,)}, rf'lacks 1 tensors .*{Q0}'
  elif kind == 'extra':
    kwargs = {'extra': {'classification_head.dense.weight':
                        np.zeros((4, 32), np.float32)}}
    message = 'does not have: classification_head.dense.weight'
  elif kind == 'shape':
    kwargs = {'extra': {Q0: np.zeros((32, 31), np.float32)}}
    message = rf'{Q0} is \[32, 31\], the config gives \[32, 32\] ' \
              r'\(\[num_heads \* d_kv, d_model\]\)'
  elif kind == 'wrong_ffn':  # gated tensors, a ReLU config
    message = (r'lacks 4 tensors .*DenseReluDense\.wi\.weight.* Check '
               'feed_forward_proj')
  elif kind == 'tied_copy':
    config = T5_1_0
    kwargs = {'extra': {'lm_head.weight': np.ones((64, 32), np.float32)}}
    message = 'lm_head.weight differs from shared.weight.*tie_word_embeddings'
  hf = tmp_path / 'hf'
  if kind in ('no_weights', 'no_config'):
    hf.mkdir()
    if kind == 'no_weights':
      (hf / 'config.json').write_text(json.dumps(T5_1_1))
      (hf / 'pytorch_model.bin').write_bytes(b'')
    message = ('neither model.safetensors nor model.safetensors.index.json'
               if kind == 'no_weights' else 'has no config.json')
    error = FileNotFoundError
  else:
    _hf_dir(hf, config, **kwargs)
    if kind == 'wrong_ffn':
      (hf / 'config.json').write_text(json.dumps(
          T5_1_1 | {'feed_forward_proj': 'relu'}))
    error = ValueError
  with pytest.raises(error, match=message):
    conversion.from_hf(str(hf), str(tmp_path / 'out'))
  assert not (tmp_path / 'out' / 'checkpoint_0').exists()


def test_tied_copies_equal_to_the_embedding_are_accepted(tmp_path):
  """Older T5 files keep the tied copies and a cross-attention bias
  transformers ignores: read, and dropped."""
  rng = np.random.default_rng(1)
  shared = rng.standard_normal((64, 32)).astype(np.float32)
  extra = {'shared.weight': shared, 'encoder.embed_tokens.weight': shared,
           'decoder.embed_tokens.weight': shared, 'lm_head.weight': shared,
           weight_names.IGNORED[0]: np.zeros((32, 2), np.float32)}
  hf, _ = _hf_dir(tmp_path / 'hf', T5_1_0, extra=extra)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  loaded = checkpoints.load_t5x_params(out.checkpoint)
  np.testing.assert_array_equal(loaded['token_embedder/embedding'], shared)


def _sentencepiece(tmp_path, pieces=60) -> str:
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  corpus = tmp_path / 'corpus.txt'
  rng = np.random.default_rng(0)
  words = 'premise hypothesis entailment sentence question answer'.split()
  corpus.write_text('\n'.join(' '.join(rng.choice(words, 8))
                              for _ in range(100)))
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / 'spm'),
      vocab_size=pieces, model_type='unigram', pad_id=0, eos_id=1, unk_id=2,
      bos_id=-1, hard_vocab_limit=False)
  return str(tmp_path / 'spm.model')


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
  model = _sentencepiece(tmp_path)
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  pieces = spm.SentencePieceProcessor(model_file=model).get_piece_size()
  hf, _ = _hf_dir(tmp_path / 'hf', T5_1_1)  # vocab_size 64 < pieces + 100
  shutil.copyfile(model, hf / 'spiece.model')  # found in the directory
  with pytest.raises(ValueError, match=rf'vocab_size 64 is smaller than the '
                     rf"tokenizer's {pieces + 100} ids .*{pieces} pieces \+ "
                     r'100 sentinels'):
    conversion.from_hf(str(hf), str(tmp_path / 'out'))
  # tokenizer_config.json's extra_ids counts; a vocabulary that fits passes.
  (hf / 'tokenizer_config.json').write_text(json.dumps({'extra_ids': 0}))
  assert pieces <= 64
  conversion.from_hf(str(hf), str(tmp_path / 'out'))


def _t5x_tiny():
  return checkpoints.load_t5x_params(
      str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'))


def test_ours_to_hf_to_ours_is_bit_identical(tmp_path):
  """A checkpoint real t5x wrote -> transformers files -> a checkpoint:
  every parameter bit for bit."""
  params = _t5x_tiny()
  cfg = conftest.T5X_TINY_CONFIG
  out = conversion.to_hf(cfg, params, str(tmp_path / 'hf'))
  assert out == {'methods': [], 'prompts': None, 'complete': True}
  config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert config['tie_word_embeddings'] is False
  back = conversion.from_hf(str(tmp_path / 'hf'), str(tmp_path / 'out'))
  loaded = checkpoints.load_t5x_params(back.checkpoint)
  assert set(loaded) == set(params)
  for k, v in params.items():
    assert loaded[k].dtype == v.dtype and loaded[k].tobytes() == v.tobytes(), k
  assert back.config.vocab_size == cfg.vocab_size


@pytest.mark.parametrize('config', [T5_1_1, T5_1_0, MT5],
                         ids=['t5_1_1', 't5_1_0', 'mt5'])
def test_hf_to_ours_to_hf_is_bit_identical(config, tmp_path):
  hf, tensors = _hf_dir(tmp_path / 'hf', config, seed=3)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  conversion.to_hf(out.config, checkpoints.load_t5x_params(out.checkpoint),
                   str(tmp_path / 'hf2'))
  again = safetensors_numpy.load_file(tmp_path / 'hf2' / 'model.safetensors')
  assert set(again) == set(tensors)
  for k, v in tensors.items():
    assert again[k].dtype == v.dtype and again[k].tobytes() == v.tobytes(), k


def test_bfloat16_weights_widen_exactly(tmp_path):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  hf, tensors = _hf_dir(tmp_path / 'hf', T5_1_1, dtype=ml_dtypes.bfloat16)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  loaded = checkpoints.load_t5x_params(out.checkpoint)
  np.testing.assert_array_equal(
      loaded['token_embedder/embedding'],
      tensors['shared.weight'].astype(np.float32))


# The methods' side: small enough to build each in a second.
METHOD_BINDINGS = ['network.T5Config.num_tasks = 4', 'DROPOUT_RATE = 0.0']


@pytest.mark.parametrize('variant', ['hyperprompt_global', 'hypergrid_lg'])
def test_a_method_starts_from_the_converted_checkpoint(variant, tmp_path):
  """INITIAL_CHECKPOINT_PATH's restore (`params_from_t5x`, the built-in
  runner's) of the converted checkpoint into a HyperPrompt / HyperGrid
  model: the backbone is transformers' tensors, the method's parameters a
  fresh run's initialisation."""
  hf, tensors = _hf_dir(tmp_path / 'hf', T5_1_1, seed=5)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  cfg = ts.build_config(variant, out.gin_file, METHOD_BINDINGS)
  trainer = trainer_lib.Trainer(
      network.Transformer(cfg), optimizers.make_optimizer(),
      partitioning.create_mesh(), {'inputs': 8, 'targets': 4})
  params, fresh, rows = initial_checkpoint.params_from_t5x(
      trainer, out.checkpoint, task_list=('a', 'b', 'c', 'd'))
  params = {k: np.asarray(v) for k, v in
            traverse_util.flatten_dict(params, sep='/').items()}
  assert fresh and rows == 0
  assert set(fresh) == {k for k in params
                        if param_groups.is_task_conditioned(k)}
  backbone = weight_names.to_hf(
      {k: v for k, v in params.items() if k not in fresh},
      weight_names.Backbone.of(cfg))
  for k, v in tensors.items():
    np.testing.assert_array_equal(backbone[k], v, err_msg=k)
  for k, v in _expected(T5_1_1, tensors).items():
    np.testing.assert_array_equal(params[k], v, err_msg=k)
  new = traverse_util.flatten_dict(trainer.fresh_params(), sep='/')
  for k in fresh:
    np.testing.assert_array_equal(params[k], np.asarray(new[k]), err_msg=k)


def _saved(tmp_path, cfg, seed=0) -> tuple[str, dict]:
  params = network.init_variables(network.Transformer(cfg),
                                  jax.random.PRNGKey(seed))
  flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(
      params['params'], sep='/').items()}
  path = checkpoints.save_t5x_params(params['params'], str(tmp_path), 3)
  return path, flat


def test_a_task_conditioned_method_exports_its_backbone_and_artifact(
    tmp_path):
  """HyperGrid to transformers: the backbone (what T5 alone has), its task
  parameters in the project's artifact, and the statement that transformers
  alone cannot run it."""
  from hyperprompt_jax import task_params  # pylint: disable=g-import-not-at-top
  hf, _ = _hf_dir(tmp_path / 'hf', T5_1_1)
  gin_file = conversion.from_hf(str(hf), str(tmp_path / 'out')).gin_file
  cfg = ts.build_config('hypergrid_lg', gin_file, METHOD_BINDINGS)
  path, flat = _saved(tmp_path / 'run', cfg)
  out = conversion.checkpoint_to_hf(network.Transformer(cfg), path,
                                    str(tmp_path / 'hf_out'),
                                    ('a', 'b', 'c', 'd'))
  assert out['methods'] == ['HyperGrid'] and not out['complete']
  tensors = safetensors_numpy.load_file(
      tmp_path / 'hf_out' / 'model.safetensors')
  assert set(tensors) == set(_hf_shapes(T5_1_1))
  arrays, header = task_params.read(out['task_params'])
  assert set(arrays) == {k for k in flat
                         if param_groups.is_task_conditioned(k)}
  assert header['task_list'] == ['a', 'b', 'c', 'd']
  statement = conversion._statement(out, 'OUT')  # pylint: disable=protected-access
  assert 'transformers alone cannot run HyperGrid' in statement
  assert 'task_params.npz' in statement


def test_prompt_tuning_prompts_are_peft_adapters(tmp_path):
  hf, _ = _hf_dir(tmp_path / 'hf', T5_1_1)
  gin_file = conversion.from_hf(str(hf), str(tmp_path / 'out')).gin_file
  cfg = ts.build_config('prompt_tuning', gin_file, METHOD_BINDINGS)
  path, flat = _saved(tmp_path / 'run', cfg, seed=1)
  tasks = ('glue_rte', 'glue_mnli', 'glue_stsb', 'glue_cola')
  out = conversion.checkpoint_to_hf(network.Transformer(cfg), path,
                                    str(tmp_path / 'hf_out'), tasks)
  assert out['complete'] and out['task_params'] is None
  prompts = flat['encoder/prompt_tuning/prompts']
  root = tmp_path / 'hf_out' / 'prompt_tuning'
  index = json.loads((root / 'prompts.json').read_text())
  assert index['shape'] == list(prompts.shape[1:])
  for task_id, task in enumerate(tasks):
    assert index['tasks'][task]['task_id'] == task_id
    got = safetensors_numpy.load_file(root / task /
                                      'adapter_model.safetensors')
    np.testing.assert_array_equal(got['prompt_embeddings'], prompts[task_id])
    config = json.loads((root / task / 'adapter_config.json').read_text())
    assert config['peft_type'] == 'PROMPT_TUNING'
    assert config['num_virtual_tokens'] == prompts.shape[1]
    assert config['token_dim'] == cfg.emb_dim


def test_the_command_converts_and_prints_the_gin_bindings(tmp_path):
  hf, _ = _hf_dir(tmp_path / 'hf', T5_1_0)
  result = subprocess.run(
      [sys.executable, '-m', 'hyperprompt_jax.convert', f'--from_hf={hf}',
       f'--output_dir={tmp_path / "out"}'], capture_output=True, text=True,
      cwd=ROOT, check=False)
  assert result.returncode == 0, result.stderr
  assert "mlp_activations = ('relu',)" in result.stdout
  assert 'logits_via_embedding = True' in result.stdout
  assert 'INITIAL_CHECKPOINT_PATH' in result.stdout
  assert (tmp_path / 'out' / 'checkpoint_0' / 'state').is_dir()
  # A refusal: one line naming the field, exit status 2.
  (hf / 'config.json').write_text(json.dumps(T5_1_0 | {'model_type':
                                                        'bart'}))
  result = subprocess.run(
      [sys.executable, '-m', 'hyperprompt_jax.convert', f'--from_hf={hf}',
       f'--output_dir={tmp_path / "out2"}'], capture_output=True, text=True,
      cwd=ROOT, check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith(
      "error: config.json: model_type 'bart' is not T5")


# ----------------------------------------------------- t5x's own restore --

def test_t5x_fine_tunes_from_the_converted_checkpoint(tmp_path):
  """`python -m t5x.train` of the HyperPrompt quickstart, INITIAL_CHECKPOINT_
  PATH the converted directory: its first checkpoint holds transformers'
  tensors as its backbone (skipped without t5x)."""
  t5x = pytest.importorskip('t5x')
  from hyperprompt_jax import paths  # pylint: disable=g-import-not-at-top
  config = T5_1_1 | {'vocab_size': 384, 'd_ff': 64}  # the quickstart's vocab
  hf, tensors = _hf_dir(tmp_path / 'hf', config, seed=6)
  out = conversion.from_hf(str(hf), str(tmp_path / 'out'))
  model_dir = tmp_path / 'model'
  conftest.run_module(
      't5x.train', f'--gin_search_paths={paths.gin_dir()}',
      '--gin_file=t5x/quickstart_train.gin',
      f"--gin.MODEL_DIR='{model_dir}'",
      f"--gin.INITIAL_CHECKPOINT_PATH='{out.checkpoint}'",
      '--gin.TRAIN_STEPS=1', '--gin.SAVE_PERIOD=1', '--gin.BATCH_SIZE=4',
      '--gin.__main__.train.train_eval_dataset_cfg=None',
      '--gin.network.T5Config.emb_dim=32', '--gin.network.T5Config.num_heads=2',
      '--gin.network.T5Config.head_dim=16',
      '--gin.network.T5Config.mlp_dim=64')
  del t5x
  restored = checkpoints.load_t5x_params(str(model_dir / 'checkpoint_0'))
  for k, v in _expected(config, tensors).items():
    np.testing.assert_array_equal(restored[k], v, err_msg=k)
  backbone = {k: v for k, v in restored.items()
              if not param_groups.is_task_conditioned(k)}
  assert set(backbone) == set(checkpoints.load_t5x_params(out.checkpoint))


def test_help_answers_without_heavy_imports():
  script = ('import runpy, sys\nsys.argv = ["x", "--help"]\ntry:\n'
            '  runpy.run_module("hyperprompt_jax.convert", run_name="__main__")'
            '\nexcept SystemExit:\n  pass\nprint(sorted(m for m in ("jax", '
            '"tensorflow", "safetensors", "orbax") if m in sys.modules))')
  result = subprocess.run([sys.executable, '-c', script], capture_output=True,
                          text=True, cwd=ROOT, check=True)
  assert '--from_hf' in result.stdout and '--to_hf' in result.stdout
  assert result.stdout.strip().splitlines()[-1] == '[]'


def test_the_command_writes_hyperprompt_as_backbone_and_artifact(
    tmp_path, capsys):
  """--to_hf of the quickstart's model (HyperPrompt-Global, gin): the
  transformers files, the artifact, and the statement."""
  import argparse  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    gin_utils.parse_gin(['runs/quickstart_model.gin'], [])
    cfg = gin.get_configurable(network.Transformer)().config
  finally:
    gin.clear_config()
  path, _ = _saved(tmp_path / 'run', cfg)
  args = argparse.Namespace(
      from_hf=None, to_hf=True, checkpoint_path=path,
      output_dir=str(tmp_path / 'hf'), step=0, sentencepiece_model=None,
      gin_file=['runs/quickstart_model.gin'], gin_bindings=[],
      gin_search_paths='')
  try:
    assert conversion.run(args) == 0
  finally:
    gin.clear_config()
  out = capsys.readouterr().out
  assert 'transformers alone cannot run HyperPrompt' in out
  assert (tmp_path / 'hf' / 'model.safetensors').is_file()
  assert (tmp_path / 'hf' / 'task_params.npz').is_file()
  config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert (config['d_model'], config['feed_forward_proj']) == (
      cfg.emb_dim, 'gated-gelu')
