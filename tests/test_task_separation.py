"""Every task-conditioned variant learns to use the task id.

The problem (`task_separation.py`): identical inputs, task k answers with the
k-th word, so only the task id separates the tasks. Each variant, built from
its gin/variants file with fresh task-conditioned parameters on an MTL
backbone (trained with the task named in the input, as a pretrained T5 knows
its tasks by their text prefixes), is fine-tuned on inputs that no longer
name it with the project's optimizer (`make_optimizer`'s defaults), in both
settings of HyperPrompt's Table 1:
  - "All": every parameter trained; MTL stays near chance, every
    task-conditioned variant separates the tasks;
  - "Task": the backbone frozen, only the task-conditioned parameters
    trained; every variant separates, except that HyperGrid's gates must only
    learn (see GATED).
The last test keeps in view why the Vanilla Adapter once failed to learn:
at the papers' rate under T5's relative steps it stays at chance.
"""

from flax import traverse_util
import numpy as np
import pytest

import multiprocess
import task_separation as ts
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers

NUM_TASKS = 4
LENGTH, WORDS, BATCH = 6, 32, 32
LEARNING_RATE = 1e-2  # the quickstart's rate
STEPS = {'backbone': 600, 'all': 150, 'task': 300, 'paper_rate': 400}
MODEL = 'models/t5_1_1_tiny.gin'
BINDINGS = (  # the quickstart's widths, one decoder layer, a small vocabulary
    'network.T5Config.vocab_size = 128',
    'network.T5Config.emb_dim = 64',
    'network.T5Config.num_heads = 4',
    'network.T5Config.head_dim = 16',
    'network.T5Config.mlp_dim = 128',
    'network.T5Config.num_decoder_layers = 1',
    'network.T5Config.num_tasks = 4',
    'DROPOUT_RATE = 0.0',
)
TASK_CONDITIONED = tuple(v for v in ts.VARIANTS if v != 'mtl')
# HyperGrid's gates scale FFN outputs by (1 + G), G in (0, 1): on a frozen
# backbone they cannot steer it to another task's answer (the HyperGrid paper
# never freezes the backbone). In the Task setting they must still learn
# (their loss falls), not separate.
GATED = ('hypergrid_l', 'hypergrid_l2', 'hypergrid_lg', 'hypergrid_gl',
         'output_gating')
SEPARATED = 0.9  # mean exact match over the tasks
CHANCE_BOUND = 0.4  # chance is 1 / NUM_TASKS
# The slower learners (HyperGrid's gates, Share's and Sep's prompts on a
# frozen backbone) take more steps than their setting's.
MORE_STEPS = {('all', v): 250 for v in GATED} | {
    ('task', 'hyperprompt_share'): 600, ('task', 'hyperprompt_sep'): 450,
    ('task', 'hypergrid_l'): 600}


def _model(variant: str) -> network.Transformer:
  return network.Transformer(ts.build_config(variant, MODEL, BINDINGS))


def _batches(seed, steps, named=False):
  return ts.make_batches(seed, steps, BATCH, NUM_TASKS, LENGTH, WORDS,
                         named=named)


@pytest.fixture(scope='module')
def eval_batch():
  return {k: v[0] for k, v in ts.make_batches(
      1000, 1, 512, NUM_TASKS, LENGTH, WORDS).items()}


@pytest.fixture(scope='module')
def mtl_backbone(tmp_path_factory):
  """MTL trained with the task named in the input: it knows the tasks, as a
  pretrained T5 knows its tasks by their text prefixes. Trained once for
  the test session (`multiprocess.made_once`: xdist's workers share it)."""
  model = _model('mtl')

  def make(root):
    params, _ = ts.train(
        model, optimizers.make_optimizer(learning_rate=LEARNING_RATE),
        ts.init_params(model), _batches(1, STEPS['backbone'], named=True))
    flat = traverse_util.flatten_dict(params, sep='/')
    np.savez(root / 'params.npz', **{k: np.asarray(v) for k, v in flat.items()})

  root = multiprocess.made_once(tmp_path_factory.getbasetemp(),
                                'task_separation_backbone', make)
  with np.load(root / 'params.npz') as saved:
    params = traverse_util.unflatten_dict(
        {k: saved[k] for k in saved.files}, sep='/')
  named = {k: v[0] for k, v in ts.make_batches(
      1001, 1, 512, NUM_TASKS, LENGTH, WORDS, named=True).items()}
  assert ts.exact_match(model, params, named, NUM_TASKS).mean() > 0.95
  return params


def _train(variant, setting, backbone, learning_rate=LEARNING_RATE,
           **optimizer_kwargs):
  """Fine-tunes `variant` from the MTL backbone (fresh task-conditioned
  parameters) on inputs that do not name the task: every parameter
  (setting 'all') or only the task-conditioned ones."""
  model = _model(variant)
  params = ts.with_backbone(ts.init_params(model), backbone)
  optimizer = optimizers.make_optimizer(
      learning_rate=learning_rate,
      train_only_task_conditioned=setting != 'all', **optimizer_kwargs)
  steps = MORE_STEPS.get((setting, variant), STEPS[setting])
  params, losses = ts.train(model, optimizer, params, _batches(0, steps))
  return model, params, losses


def test_mtl_cannot_separate_the_tasks(eval_batch, mtl_backbone):
  model, params, _ = _train('mtl', 'all', mtl_backbone)
  assert ts.exact_match(model, params, eval_batch,
                        NUM_TASKS).mean() < CHANCE_BOUND
  # The backbone itself, asked without the task's name.
  assert ts.exact_match(model, mtl_backbone, eval_batch,
                        NUM_TASKS).mean() < CHANCE_BOUND


@pytest.mark.parametrize('variant', TASK_CONDITIONED)
def test_separates_the_tasks_training_all_parameters(variant, eval_batch,
                                                     mtl_backbone):
  model, params, _ = _train(variant, 'all', mtl_backbone)
  scores = ts.exact_match(model, params, eval_batch, NUM_TASKS)
  assert scores.mean() > SEPARATED, scores


@pytest.mark.parametrize('variant', TASK_CONDITIONED)
def test_learns_on_a_frozen_backbone(variant, eval_batch, mtl_backbone):
  model, params, losses = _train(variant, 'task', mtl_backbone)
  scores = ts.exact_match(model, params, eval_batch, NUM_TASKS)
  if variant in GATED:
    assert losses[-50:].mean() < 0.8 * losses[:10].mean(), losses
  else:
    assert scores.mean() > SEPARATED, scores


@pytest.mark.parametrize('t5_relative_steps', [False, True])
def test_vanilla_adapter_at_the_papers_rate(t5_relative_steps, eval_batch,
                                            mtl_backbone):
  """The mechanism: at the papers' rate (1e-3) on the frozen backbone, the
  Vanilla Adapter's near-zero start (weights N(0, 0.01^2), zero biases)
  under Adafactor's relative steps moves by ~1e-3 of the rate a step and
  stays near chance; absolute steps (the default for its scope) separate."""
  kwargs = {'multiply_by_parameter_scale': True} if t5_relative_steps else {}
  model, params, _ = _train('adapter', 'paper_rate', mtl_backbone,
                            learning_rate=1e-3, **kwargs)
  score = ts.exact_match(model, params, eval_batch, NUM_TASKS).mean()
  if t5_relative_steps:
    assert score < CHANCE_BOUND
  else:
    assert score > SEPARATED
