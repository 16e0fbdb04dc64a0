"""transformers' T5 as a second reference (skipped without transformers and
PyTorch: `pip install -e '.[hf]'`).

The network's weights, written by `python -m hyperprompt_jax.convert
--to_hf`'s library, are loaded by transformers' own
`T5ForConditionalGeneration.from_pretrained`; its logits and encoder outputs
(PyTorch, float32) must equal the network's (JAX, float32) and the
independent float64 numpy T5 (tests/numpy_t5.py) within float32 rounding.

The bound: both float32 computations differ from the exact result only by
rounding, and a chain of sums of lengths n_1, n_2, ... is within
2 u (n_1 + n_2 + ...) of it relative to the magnitude of its terms
(`conftest.float32_bound`, u = 2^-24; the chain is `conftest.
t5_forward_lengths`: per layer the projections over d_model, the scores
over head_dim, the attention over the keys, the output projection over
heads * head_dim, the MLP over d_model and d_ff, then the logits over
d_model). The magnitude is the output's largest entry. A wrong name, a
missing transpose or a misplaced scale changes the outputs by their own
size, orders of magnitude above it.

Also: transformers' T5 tokenizer built from a SentencePiece model gives the
ids of seqio's SentencePieceVocabulary of the same model (sentinels
included), and a Prompt-Tuning model equals transformers fed its prompt as
PEFT's prompt tuning does (the prompt embeddings the export writes,
prepended to the encoder's input embeddings).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

# pylint: disable=g-import-not-at-top,g-bad-import-order
from safetensors import numpy as safetensors_numpy

import conftest
import numpy_t5
from hyperprompt_jax.huggingface import conversion
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network

BASE = network.T5Config(
    vocab_size=160, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
    num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
    num_tasks=3)
SHAPES = {
    # T5.1.1 / LM-adapted / Flan-T5 / mT5: gated GELU, untied lm_head.
    't5_1_1': BASE,
    # T5 v1.0: ReLU, logits through the (scaled) embedding.
    't5_1_0': dataclasses.replace(BASE, mlp_activations=('relu',),
                                  logits_via_embedding=True),
    # Stacks of different depths (transformers' num_decoder_layers).
    'asymmetric': dataclasses.replace(BASE, num_decoder_layers=3),
}
INPUTS, TARGETS = 9, 6


def _params(cfg: network.T5Config, seed: int) -> dict[str, np.ndarray]:
  """Random float32 parameters: the network's initialisation, with the
  layer-norm scales (initialised to ones) drawn too, so that a misplaced
  norm shows."""
  params = network.init_variables(network.Transformer(cfg),
                                  jax.random.PRNGKey(seed))['params']
  rng = np.random.default_rng(seed)
  out = {}
  for k, v in conftest.flat(params).items():
    if k.endswith('/scale'):
      v = rng.uniform(0.5, 1.5, v.shape)
    out[k] = v.astype(np.float32)
  return out


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  enc = conftest.random_tokens(rng, (3, INPUTS), BASE.vocab_size,
                               pad_from=[INPUTS, 6, 3])
  tgt = conftest.random_tokens(rng, (3, TARGETS), BASE.vocab_size,
                               pad_from=[TARGETS, 4, 2])
  dec_in = conftest.decoder_inputs(tgt)
  return enc, dec_in, tgt


def _hf_model(path):
  model = transformers.T5ForConditionalGeneration.from_pretrained(
      str(path), attn_implementation='eager', dtype=torch.float32)
  return model.eval()


def _ours(cfg, params, enc, dec_in, tgt, task_ids=None):
  model = network.Transformer(cfg)
  variables = {'params': jax.tree.map(np.asarray, _nested(params))}
  if task_ids is None:
    task_ids = np.zeros((enc.shape[0],), np.int32)
  logits = model.apply(variables, enc, dec_in, tgt, enable_dropout=False,
                       task_ids=task_ids)
  encoded = model.apply(variables, enc, enable_dropout=False,
                        task_ids=task_ids, method=model.encode)
  return np.asarray(logits), np.asarray(encoded)


def _nested(flat):
  out = {}
  for k, v in flat.items():
    *scopes, leaf = k.split('/')
    node = out
    for s in scopes:
      node = node.setdefault(s, {})
    node[leaf] = v
  return out


def _theirs(hf, enc, dec_in, tgt, inputs_embeds=None, encoder_mask=None):
  with torch.no_grad():
    mask = torch.tensor(enc > 0 if encoder_mask is None else encoder_mask,
                        dtype=torch.long)
    source = ({'input_ids': torch.tensor(enc, dtype=torch.long)}
              if inputs_embeds is None else {'inputs_embeds': inputs_embeds})
    out = hf(**source, attention_mask=mask,
             decoder_input_ids=torch.tensor(dec_in, dtype=torch.long),
             decoder_attention_mask=torch.tensor(tgt > 0, dtype=torch.long))
  return out.logits.numpy(), out.encoder_last_hidden_state.numpy()


def _reference(cfg, params, enc, dec_in, tgt):
  """float64 numpy logits and encoder outputs, one example at a time."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  gated = len(cfg.mlp_activations) == 2
  logits, encoded = [], []
  for e, d, t in zip(enc, dec_in, tgt):
    x = numpy_t5.encode(p, e, cfg.num_heads, cfg.num_encoder_layers, gated)
    encoded.append(x)
    logits.append(numpy_t5.decode(p, x, e, d, t, cfg.num_heads,
                                  cfg.num_decoder_layers, gated,
                                  cfg.logits_via_embedding))
  return np.stack(logits), np.stack(encoded)


@pytest.mark.parametrize('shape', sorted(SHAPES))
def test_logits_and_encoder_outputs_equal_transformers(shape, tmp_path):
  cfg = SHAPES[shape]
  params = _params(cfg, seed=len(shape))
  out = conversion.to_hf(cfg, params, str(tmp_path / 'hf'))
  assert out['complete'] and not out['methods']
  hf = _hf_model(tmp_path / 'hf')
  assert hf.config.num_decoder_layers == cfg.num_decoder_layers
  enc, dec_in, tgt = _batch()
  ours_logits, ours_encoded = _ours(cfg, params, enc, dec_in, tgt)
  hf_logits, hf_encoded = _theirs(hf, enc, dec_in, tgt)
  want_logits, want_encoded = _reference(cfg, params, enc, dec_in, tgt)
  valid_targets, valid_inputs = tgt > 0, enc > 0
  logits_bound = conftest.float32_bound(
      *conftest.t5_forward_lengths(cfg, INPUTS, TARGETS))
  encoder_bound = conftest.float32_bound(
      *conftest.t5_forward_lengths(cfg, INPUTS))
  for name, got in (('ours', ours_logits), ('transformers', hf_logits)):
    conftest.assert_close_to_scale(got[valid_targets],
                                   want_logits[valid_targets], logits_bound,
                                   name=f'{name} logits vs float64')
  conftest.assert_close_to_scale(ours_logits[valid_targets],
                                 hf_logits[valid_targets], logits_bound,
                                 name='ours vs transformers logits')
  for name, got in (('ours', ours_encoded), ('transformers', hf_encoded)):
    conftest.assert_close_to_scale(got[valid_inputs],
                                   want_encoded[valid_inputs], encoder_bound,
                                   name=f'{name} encoded vs float64')
  conftest.assert_close_to_scale(ours_encoded[valid_inputs],
                                 hf_encoded[valid_inputs], encoder_bound,
                                 name='ours vs transformers encoded')


def test_prompt_tuning_equals_transformers_with_its_peft_prompts(tmp_path):
  """Each task's exported prompt, prepended to transformers' input
  embeddings with an attended mask (PEFT's prompt tuning, one transformer
  submodule), gives the Prompt-Tuning model's logits for that task."""
  cfg = dataclasses.replace(
      BASE, prompt_tuning=prompt_tuning.PromptTuningConfig(prompt_length=3))
  params = _params(cfg, seed=7)
  tasks = ('task_a', 'task_b', 'task_c')
  out = conversion.to_hf(cfg, params, str(tmp_path / 'hf'), tasks)
  assert out['complete'] and out['methods'] == ['Prompt-Tuning']
  hf = _hf_model(tmp_path / 'hf')
  enc, dec_in, tgt = _batch(seed=3)
  task_ids = np.array([2, 0, 1], np.int32)
  ours_logits, _ = _ours(cfg, params, enc, dec_in, tgt, task_ids)
  index = json.loads((tmp_path / 'hf' / 'prompt_tuning' /
                      'prompts.json').read_text())
  prompts = []
  for task_id in task_ids:
    task = tasks[task_id]
    assert index['tasks'][task]['task_id'] == task_id
    adapter = tmp_path / 'hf' / 'prompt_tuning' / task
    config = json.loads((adapter / 'adapter_config.json').read_text())
    assert (config['peft_type'], config['num_virtual_tokens'],
            config['num_transformer_submodules']) == ('PROMPT_TUNING', 3, 1)
    prompts.append(safetensors_numpy.load_file(
        adapter / 'adapter_model.safetensors')['prompt_embeddings'])
  with torch.no_grad():
    embeds = hf.get_input_embeddings()(torch.tensor(enc, dtype=torch.long))
    embeds = torch.cat([torch.tensor(np.stack(prompts)), embeds], dim=1)
  mask = np.concatenate([np.ones((3, 3), bool), enc > 0], axis=1)
  hf_logits, _ = _theirs(hf, enc, dec_in, tgt, embeds, mask)
  bound = conftest.float32_bound(
      *conftest.t5_forward_lengths(cfg, INPUTS + 3, TARGETS))
  conftest.assert_close_to_scale(ours_logits[tgt > 0], hf_logits[tgt > 0],
                                 bound, name='Prompt-Tuning logits')


def test_tokenizer_ids_equal_seqio(tmp_path):
  """transformers' T5Tokenizer, loaded from the tokenizer files the
  conversion writes for a SentencePiece model, numbers text, EOS and the
  sentinels as seqio's SentencePieceVocabulary of that model does."""
  import seqio
  import sentencepiece as spm
  corpus = tmp_path / 'corpus.txt'
  words = ('premise hypothesis entailment contradiction neutral sentence '
           'question answer passage true false the a of to is was').split()
  rng = np.random.default_rng(0)
  corpus.write_text('\n'.join(' '.join(rng.choice(words, 12))
                              for _ in range(200)) + '\n', encoding='utf-8')
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / 'spm'), vocab_size=60,
      model_type='unigram', pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      hard_vocab_limit=False)
  model_file = str(tmp_path / 'spm.model')
  vocab = seqio.SentencePieceVocabulary(model_file, extra_ids=100)
  # The files `convert --to_hf --sentencepiece_model` writes.
  conversion.write_tokenizer(str(tmp_path), model_file)
  tokenizer = transformers.T5Tokenizer.from_pretrained(str(tmp_path))
  texts = ['rte sentence1: the premise is true. sentence2: a hypothesis',
           'question: was the passage false? answer:', 'zebra 42 ünïcode',
           ' leading and  double  spaces ']
  for text in texts:
    want = [int(i) for i in vocab.encode(text)]
    assert tokenizer(text, add_special_tokens=False).input_ids == want, text
    assert tokenizer(text).input_ids == want + [vocab.eos_id], text
  assert len(tokenizer) == vocab.vocab_size
  for i in (0, 1, 99):
    assert tokenizer.convert_tokens_to_ids(f'<extra_id_{i}>') == (
        vocab.vocab_size - 1 - i)
