"""The attention probe (HyperPrompt Fig. 3 / §A.3): its statistics against
numpy, hand-set attention whose answer is known, and the command end to
end."""

import dataclasses
import json
import math

from flax import traverse_util
import jax
import numpy as np
import orbax.checkpoint as ocp

from hyperprompt_jax.evaluation import attention_probe
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import layers

import conftest
import numpy_hyperprompt
import numpy_t5

HP = conftest.TINY_GLOBAL_PROMPTS
# Two examples of 6 and 4 real input tokens, 3 and 2 real target tokens.
ENC = np.array([[5, 9, 3, 7, 2, 8], [4, 6, 11, 3, 0, 0]], np.int32)
TGT = np.array([[3, 4, 1], [6, 1, 0]], np.int32)
TASKS = np.array([1, 3], np.int32)


def _batch():
  dec_in = np.concatenate([np.zeros((2, 1), np.int32), TGT[:, :-1]], 1)
  return {'encoder_input_tokens': ENC, 'decoder_input_tokens': dec_in,
          'decoder_target_tokens': TGT, 'task_ids': TASKS}


def _model(**overrides):
  return network.Transformer(dataclasses.replace(
      conftest.T5X_TINY_CONFIG, **overrides))


def _params(model, seed=0):
  batch = _batch()
  return jax.jit(lambda r: model.init(
      r, batch['encoder_input_tokens'], batch['decoder_input_tokens'],
      batch['decoder_target_tokens'], enable_dropout=False,
      task_ids=batch['task_ids']))(jax.random.PRNGKey(seed))['params']


_PROBE_STEPS = {}


def _probe_step(model):
  """`attention_probe.make_probe_step(model)`, made once per configuration: tests of
  one model share its compiled step (their parameters differ, not the
  program)."""
  if model.config not in _PROBE_STEPS:
    _PROBE_STEPS[model.config] = attention_probe.make_probe_step(model)
  return _PROBE_STEPS[model.config]


def _bound(columns, queries):
  """float32 rounding of a probe statistic over `columns` keys summed over
  `queries` (the softmax's sum, the statistic's sum over the columns, the
  sum over the queries; a log, a division), relative to the statistic;
  an entropy's is relative to it + 1 (each weight rounded to within u
  adds u (|log p| + 1): at most u (entropy + 1) over weights summing to 1)."""
  return conftest.float32_bound(columns, columns, queries, 2)


def _entropy(p):
  p = np.asarray(p, np.float64)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)


def test_statistics_against_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5, 7))
  w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  got = jax.device_get(attention_probe.attention_statistics(w, 3))
  mass = w[..., :3].sum(-1)
  conftest.assert_close_to_scale(got['prompt_mass'], mass, _bound(7, 1),
                                 mass)
  entropy = _entropy(w)
  conftest.assert_close_to_scale(got['entropy'], entropy, _bound(7, 1),
                                 entropy + 1)
  tokens = w[..., 3:] / w[..., 3:].sum(-1, keepdims=True)
  entropy = _entropy(tokens)
  conftest.assert_close_to_scale(got['token_entropy'], entropy,
                                 _bound(7, 1), entropy + 1)


def _per_task(values, valid):
  """{task: [heads] mean over the real queries of that task's examples}."""
  out = {}
  for task in sorted(set(TASKS.tolist())):
    rows = [v[:, m] for v, m, t in zip(values, valid, TASKS) if t == task]
    out[task] = np.concatenate(rows, axis=1).mean(1)
  return out


def test_encoder_statistics_equal_a_numpy_attention():
  """HyperPrompt-Global with random parameters: the probe's encoder numbers
  against the probabilities of the numpy re-derivation (numpy_t5 +
  numpy_hyperprompt)."""
  model = _model(hyperprompt=HP)
  params = _params(model)
  out = jax.device_get(_probe_step(model)(params, _batch()))
  p = conftest.flat(params)
  prompts = numpy_hyperprompt.stack_prompts(p, 'encoder', 'global', 2, 2)
  per_example = []
  for tokens, task in zip(ENC, TASKS):
    record = []
    numpy_t5.encode(p, tokens, 2, 2, prompts=[prompts[task, m]
                                              for m in range(2)],
                    record=record)
    per_example.append(record)  # [layers] of [heads, q, 4 + k]
  valid = ENC > 0
  # The encoder's forward pass to the layer's probabilities (relative to
  # their sum, 1), then the statistics over its 4 + 6 columns.
  bound = conftest.float32_bound(*conftest.model_forward_lengths(
      model.config, 6)) + _bound(4 + 6, 6)
  for layer in range(2):
    w = [r[layer] for r in per_example]
    mass = _per_task([x[..., :4].sum(-1) for x in w], valid)
    ent = _per_task([_entropy(x) for x in w], valid)
    for task in mass:
      count = out['counts']['encoder'][task]
      conftest.assert_close_to_scale(
          out['encoder']['prompt_mass'][layer, task] / count, mass[task],
          bound, 1.0)
      conftest.assert_close_to_scale(
          out['encoder']['entropy'][layer, task] / count, ent[task], bound,
          ent[task] + 1)
  assert out['counts']['encoder'][1] == 6 and out['counts']['encoder'][3] == 4


def _hand_set(params, relpos):
  """Zero query kernels (every logit is its bias alone) and the relative
  position biases set to `relpos`: tokens get `relpos`, prompts 0."""
  flat = traverse_util.flatten_dict(params, sep='/')
  for k in flat:
    if k.endswith('query/kernel'):
      flat[k] = np.zeros_like(flat[k])
    if k.endswith('relpos_bias/rel_embedding'):
      flat[k] = np.full_like(flat[k], relpos)
  return traverse_util.unflatten_dict(flat, sep='/')


def test_prompt_columns_far_above_the_tokens_take_all_the_mass():
  """Token logits -30, prompt logits 0: every query's mass is on the l
  prompts (1), spread evenly (entropy log l); without the prompts, the
  renormalised token distribution is even over the real tokens."""
  model = _model(hyperprompt=HP)
  params = _hand_set(_params(model), -30.0)
  out = jax.device_get(_probe_step(model)(params, _batch()))
  # The tokens' weights, e^-30 of the prompts', are below float32's
  # rounding of them: what is left is rounding (`_bound`).
  bound = _bound(4 + 6, 6)
  for stack, l in (('encoder', 4), ('decoder', 2)):
    count = out['counts'][stack]
    for task in (1, 3):
      conftest.assert_close_to_scale(
          out[stack]['prompt_mass'][:, task] / count[task], np.ones((2, 2)),
          bound)
      conftest.assert_close_to_scale(
          out[stack]['entropy'][:, task] / count[task],
          np.full((2, 2), math.log(l)), bound, math.log(l) + 1)
  # Encoder: every real query sees all real tokens evenly (6 and 4).
  enc = out['encoder']
  for task, n in ((1, 6), (3, 4)):
    conftest.assert_close_to_scale(enc['token_entropy'][:, task] / n,
                                   np.full((2, 2), math.log(n)), bound,
                                   math.log(n) + 1)
  # Decoder self-attention: query i sees tokens 0..i (causal).
  dec = out['decoder']
  want = (math.log(1) + math.log(2) + math.log(3)) / 3
  conftest.assert_close_to_scale(dec['token_entropy'][:, 1] / 3,
                                 np.full((2, 2), want), bound, want + 1)


def test_mtl_has_entropy_and_no_mass():
  model = _model()
  params = _hand_set(_params(model), 0.0)
  out = jax.device_get(_probe_step(model)(params, _batch()))
  enc = out['encoder']
  np.testing.assert_allclose(enc['prompt_mass'], 0.0)
  conftest.assert_close_to_scale(enc['entropy'][:, 1] / 6,
                                 np.full((2, 2), math.log(6)), _bound(6, 6),
                                 math.log(6) + 1)
  assert not attention_probe.has_prompts(model.config, 'encoder')


def test_prompt_tuning_mass_is_on_the_soft_prompt_positions():
  """n soft prompts before the tokens, every logit 0: the even split puts
  n / (n + real tokens) on the prompts, for encoder and cross attention."""
  model = _model(prompt_tuning=prompt_tuning.PromptTuningConfig(
      prompt_length=3))
  params = _hand_set(_params(model), 0.0)
  out = jax.device_get(_probe_step(model)(params, _batch()))
  for stack in ('encoder', 'cross'):
    count = out['counts'][stack]
    for task, columns in ((1, 9), (3, 7)):
      conftest.assert_close_to_scale(
          out[stack]['prompt_mass'][:, task] / count[task],
          np.full((2, 2), 3 / columns), _bound(columns, 6), 3 / columns)
  # The soft prompts are not queries: 6 and 4 real encoder queries.
  assert out['counts']['encoder'][1] == 6
  assert attention_probe.has_prompts(model.config, 'cross')
  assert not attention_probe.has_prompts(model.config, 'decoder')


def test_the_probe_changes_nothing_when_off():
  model = _model(hyperprompt=HP)
  params = _params(model)
  b = _batch()
  args = (b['encoder_input_tokens'], b['decoder_input_tokens'],
          b['decoder_target_tokens'])
  # Compiled, as every runner calls the model (and in a fraction of the
  # time of op-by-op dispatch).
  plain = jax.jit(lambda p: model.apply(
      {'params': p}, *args, task_ids=TASKS, enable_dropout=False))(params)
  probed, state = jax.jit(lambda p: model.apply(
      {'params': p}, *args, task_ids=TASKS, enable_dropout=False,
      mutable=[layers.PROBE_COLLECTION]))(params)
  np.testing.assert_array_equal(plain, probed)
  assert state[layers.PROBE_COLLECTION]


def test_probe_command_writes_json_and_plots(tmp_path):
  model = _model(hyperprompt=HP, num_tasks=16)
  params = jax.device_get(_params(model))
  for step in (10, 20):
    ocp.PyTreeCheckpointer().save(
        tmp_path / 'run' / f'checkpoint_{step}' / 'state',
        {'params': params, 'step': np.int32(step)})
  summary = attention_probe.probe(
      model, job=checkpoint_job.CheckpointJob(
          checkpoint_path=str(tmp_path / 'run'),
          output_dir=str(tmp_path / 'out'),
          mixture_or_task_name='fixture_glue_rte',
          task_feature_lengths={'inputs': 64, 'targets': 8}, batch_size=4),
      num_examples=5)
  written = json.loads((tmp_path / 'out' / 'probe.json').read_text())
  assert written == json.loads(json.dumps(summary))
  assert sorted(written['steps']) == ['10', '20']
  rte = written['steps']['20']['encoder']['glue_rte']
  assert len(rte['prompt_mass']) == 2 and len(rte['prompt_mass'][0]) == 2
  assert all(0 < m < 1 for layer in rte['prompt_mass'] for m in layer)
  assert written['steps']['20']['cross']['glue_rte']['prompt_mass'] is None
  for stack in attention_probe.STACKS:
    png = (tmp_path / 'out' / f'probe_{stack}.png').read_bytes()
    assert png[:4] == b'\x89PNG'
