"""Shared fixtures: tiny configurations, their parameters and test data."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The tests compile hundreds of tiny programs and run each a few times, so
# compiling them quickly matters more than the speed of the code made: no
# LLVM optimisation of XLA:CPU's generated code, and its older elemental
# emitters instead of the MLIR fusion emitters (a train step of the tiny
# model compiles in ~2.1 s instead of ~3.0 s, runs as fast and gives the same
# bits). HLO passes are unchanged; the tests' subprocesses inherit the flags
# (multiprocess.env keeps them).
FAST_COMPILE = ('--xla_backend_optimization_level=0',
                '--xla_cpu_use_fusion_emitters=false')
_flags = os.environ.get('XLA_FLAGS', '').split()
_set = {f.split('=')[0] for f in _flags}  # a developer's own setting wins
os.environ['XLA_FLAGS'] = ' '.join(
    _flags + [f for f in FAST_COMPILE if f.split('=')[0] not in _set])

# One persistent compilation cache for the test session, made by the first
# process (pytest, or xdist's controller) and inherited by its workers and by
# the runs they start as processes: a resumed run, a second host or a later
# test of the same configuration loads the programs compiled before instead
# of compiling them again. Every program is kept, however quick to compile:
# each process would otherwise compile again the hundreds of one-op programs
# of eager code (~50 ms each; read back in ~1 ms). A developer may point
# JAX_COMPILATION_CACHE_DIR at a lasting folder (entries are keyed by
# program, flags and jax version).
_SESSION_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _SESSION_CACHE = tempfile.mkdtemp(prefix='hyperprompt_jax_xla_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _SESSION_CACHE
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
# No size bound: with one, JAX locks the folder and scans every entry at each
# write (thousands here: minutes of a suite). Unlocked, a process that reads
# an entry another is still writing warns and compiles the program itself.

from flax import traverse_util  # pylint: disable=g-import-not-at-top
import jax
import numpy as np
import pytest

from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import task_ids

TESTDATA = pathlib.Path(__file__).parent / 'testdata'
# Tests that compile for a TPU slice from this host need the TPU compiler.
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason="libtpu is not installed (pip install -e '.[tpu]')")
T5X_TINY = TESTDATA / 't5x_tiny'

# The configuration real t5x trained the checkpoints in testdata/t5x_tiny with
# (its model.gin): vocab 384, d 32, 2 heads of 16, 2 + 2 layers, d_ff 64.
T5X_TINY_CONFIG = network.T5Config(
    vocab_size=384, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
    num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
    num_tasks=4,
)

# HyperPrompt-Global at that size: the conditioned model of the runner,
# fault, MetaBalance, microbatch and probe tests.
TINY_GLOBAL_PROMPTS = hyperprompt.HyperPromptConfig(
    variant='global', encoder_prompt_length=4, decoder_prompt_length=2,
    hypernet_reduction=8, task_embed_dim=8, task_hidden_dim=16,
    layer_task_embed_dim=8)


# -- float32 rounding ----------------------------------------------------------
#
# Two float32 computations of one value that differ only in the order of
# their sums (sharding, rematerialisation, fusion, another CPU's vector width)
# differ by rounding. A sum of n terms is within gamma_n ~ n * u of the exact
# sum, relative to the sum of the terms' magnitudes (Higham, Accuracy and
# Stability of Numerical Algorithms, Sec. 4.2; u = 2^-24, float32's unit
# roundoff); to first order the stages of a chain of reductions add their
# bounds, and each of the two orders is within the bound of the exact value
# (the factor 2; against a float64 reference one order, so the factor is
# slack). The bound is relative to the tensor's norm (`assert_close_in_norm`)
# or to its largest entry (`assert_close_to_scale`), for tensors not
# dominated by cancelling terms (gradients and activations of random
# networks); where the terms' magnitudes are known per entry (one sum, one
# product), it is relative to those. An elementwise operation (an
# activation, a division) adds about u, small beside the sums' n * u, and an
# exact result (a masked score's zero weight) is compared exactly.
FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def float32_bound(*reduction_lengths: int) -> float:
  """The relative difference two summation orders may make through a chain
  of reductions of these lengths."""
  return 2 * FLOAT32_UNIT_ROUNDOFF * sum(reduction_lengths)


BFLOAT16_UNIT_ROUNDOFF = 2.0 ** -8


def bfloat16_bound(*reduction_lengths: int) -> float:
  """The relative difference bfloat16 activations make against float32
  through a chain of reductions of these lengths: each reduction rounds its
  inputs and its weights to bfloat16 (u_bf16 each, to first order) and sums
  in float32 (XLA's dots accumulate bfloat16 in float32)."""
  return (2 * BFLOAT16_UNIT_ROUNDOFF * len(reduction_lengths)
          + float32_bound(*reduction_lengths))


def t5_forward_lengths(cfg: network.T5Config, input_length: int,
                       target_length: int = 0, encoder_prompt: int = 0,
                       decoder_prompt: int = 0) -> list[int]:
  """The reductions a T5 forward pass chains up to the logits (per layer:
  the query / key / value projections over d_model, the scores over
  head_dim, attention over the keys, the output projection over heads *
  head_dim, the MLP over d_model and d_ff; the logits over d_model);
  `target_length` 0: up to the encoder's output."""
  joined = cfg.num_heads * cfg.head_dim
  mlp = [cfg.emb_dim, cfg.mlp_dim]

  def attention(keys):
    return [cfg.emb_dim, cfg.head_dim, keys, joined]

  encoder = (attention(input_length + encoder_prompt) + mlp) * (
      cfg.num_encoder_layers)
  if not target_length:
    return encoder
  decoder = (attention(target_length + decoder_prompt)
             + attention(input_length) + mlp)
  return encoder + decoder * cfg.num_decoder_layers + [cfg.emb_dim]


def model_forward_lengths(cfg: network.T5Config, input_length: int,
                          target_length: int = 0) -> list[int]:
  """`t5_forward_lengths` of a task-conditioned model: every task's prompts
  more keys (HyperPrompt's, as its packed 'all_tasks' form scores them; a
  soft prompt's slots) and, per layer, one more attention and projection
  pair, which bounds a method's own chain (a conditioning query, a gate,
  an adapter's down and up projections, a hypernetwork)."""
  encoder_prompt = decoder_prompt = 0
  if hp := cfg.hyperprompt:
    encoder_prompt = hp.encoder_prompt_length * cfg.num_tasks
    decoder_prompt = hp.decoder_prompt_length * cfg.num_tasks
  if soft := cfg.prompt_tuning:
    input_length += soft.prompt_length
  lengths = t5_forward_lengths(cfg, input_length, target_length,
                               encoder_prompt, decoder_prompt)
  if network.is_task_conditioned(cfg):
    layers = cfg.num_encoder_layers + (
        cfg.num_decoder_layers if target_length else 0)
    lengths += [cfg.emb_dim, cfg.head_dim, input_length + 1,
                cfg.num_heads * cfg.head_dim, cfg.emb_dim,
                cfg.emb_dim] * layers
  return lengths


def model_reduction_lengths(cfg: network.T5Config, batch: int,
                            input_length: int, target_length: int
                            ) -> list[int]:
  """`t5_reduction_lengths` of a task-conditioned model
  (`model_forward_lengths`)."""
  forward = model_forward_lengths(cfg, input_length, target_length) + [
      cfg.vocab_size]
  return 2 * forward + [batch * max(input_length, target_length)]


def t5_reduction_lengths(cfg: network.T5Config, batch: int,
                         input_length: int, target_length: int,
                         encoder_prompt: int = 0,
                         decoder_prompt: int = 0) -> list[int]:
  """The reductions a T5 forward and backward pass chains (the forward pass
  and the softmax over the vocabulary, each taken twice: forward,
  backward), then a weight's gradient summed over the batch's tokens."""
  forward = t5_forward_lengths(cfg, input_length, target_length,
                               encoder_prompt, decoder_prompt) + [
                                   cfg.vocab_size]
  return 2 * forward + [batch * max(input_length, target_length)]


def assert_close_in_norm(got, want, bound: float, name: str = '') -> None:
  """|got - want| / |want| <= bound (Frobenius norms)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
  assert error <= bound, f'{name}: relative difference {error:.2e} > {bound:.2e}'


def assert_close_to_scale(got, want, bound: float, scale=None,
                          name: str = '') -> None:
  """|got - want| <= bound * scale, elementwise. `scale`: the magnitude the
  rounding is relative to (broadcast against `want`), by default the
  tensor's largest |want| (a sum's rounding is relative to its terms'
  magnitudes, not to an entry that cancels to near zero)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  if scale is None:
    scale = np.abs(want).max(initial=0.0)
  limit = bound * np.broadcast_to(scale, want.shape)
  error = np.abs(got - want)
  worst = np.unravel_index(np.argmax(error - limit), want.shape) if (
      want.size) else ()
  assert (error <= limit).all(), (
      f'{name}: |difference| {error[worst]:.2e} > {limit[worst]:.2e} '
      f'at {worst} ({int((error > limit).sum())} of {want.size})')


# One hand-made evaluation of every GLUE task (seqio task -> metrics): task
# scores CoLA 40, SST-2 90, MRPC 86, STS-B 85, QQP 75, MNLI (82 + 80) / 2 =
# 81, QNLI 88, RTE 70; GLUE average 76.875.
GLUE_METRICS = {
    'glue_cola': {'matthews_corrcoef': 40.0},
    'glue_sst2': {'accuracy': 90.0},
    'glue_mrpc': {'f1': 88.0, 'accuracy': 84.0},
    'glue_stsb': {'pearson_corrcoef': 86.0, 'spearman_corrcoef': 84.0},
    'glue_qqp': {'f1': 70.0, 'accuracy': 80.0},
    'glue_mnli_matched': {'accuracy': 82.0},
    'glue_mnli_mismatched': {'accuracy': 80.0},
    'glue_qnli': {'accuracy': 88.0},
    'glue_rte': {'accuracy': 70.0},
}


def pytest_unconfigure(config):
  del config
  if _SESSION_CACHE:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _task_ids_restored():
  """A test that registers a task (`tasks.add_task`, or a gin file importing
  tasks/example_new_task.py) appends to every run's task list in its
  process; the next test in that worker gets the list back as it was."""
  appended = list(task_ids._APPENDED)  # pylint: disable=protected-access
  yield
  task_ids._APPENDED[:] = appended  # pylint: disable=protected-access


def run_module(module: str, *args: str, timeout: int = 600) -> str:
  """Runs `python -m module args` on the CPU, failing with its output's
  tail; returns its stdout."""
  result = subprocess.run(
      [sys.executable, '-m', module, *args],
      env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True,
      text=True, timeout=timeout)
  assert result.returncode == 0, (
      f'python -m {module} failed:\n{result.stdout[-3000:]}\n'
      f'{result.stderr[-6000:]}')
  return result.stdout


def flat(params) -> dict[str, np.ndarray]:
  """Nested params -> '/'-keyed dict of float64 numpy arrays."""
  return {k: np.asarray(v, np.float64)
          for k, v in traverse_util.flatten_dict(params, sep='/').items()}


def random_tokens(rng: np.random.Generator, shape, vocab=384, pad_from=None):
  """Tokens in [1, vocab); positions >= pad_from[i] of row i are padding."""
  tokens = rng.integers(1, vocab, size=shape).astype(np.int32)
  if pad_from is not None:
    for row, start in enumerate(pad_from):
      tokens[row, start:] = 0
  return tokens


@pytest.fixture(scope='session')
def tiny_model_and_params():
  """The t5x test-data configuration with random float32 parameters."""
  model = network.Transformer(T5X_TINY_CONFIG)
  enc = np.ones((1, 8), np.int32)
  dec = np.ones((1, 4), np.int32)
  variables = jax.jit(
      lambda rng: model.init(rng, enc, dec, dec, enable_dropout=False)
  )(jax.random.PRNGKey(0))
  return model, variables['params']


def decoder_inputs(targets: np.ndarray) -> np.ndarray:
  """Targets shifted right behind a 0 start token (T5's decoder inputs)."""
  start = np.zeros((targets.shape[0], 1), targets.dtype)
  return np.concatenate([start, targets[:, :-1]], 1)


def decode_with_cache(model, params, enc, dec_in, task_ids,
                      step_task_ids='same'):
  """Greedy-style incremental decoding of given decoder inputs.

  Encodes `enc`, creates the cache with the full target shape and `task_ids`
  (as t5x does), then feeds `dec_in` one position at a time, with
  `step_task_ids` (default: the same ids; None checks nothing is regenerated).

  Returns:
    `(logits [batch, length, vocab], the freshly created cache)`.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if isinstance(step_task_ids, str):
    step_task_ids = task_ids
  length = dec_in.shape[1]
  encoded = model.apply({'params': params}, enc, enable_dropout=False,
                        task_ids=task_ids, method=model.encode)
  _, variables = model.apply(
      {'params': params}, encoded, enc, jnp.ones_like(dec_in),
      jnp.ones_like(dec_in), enable_dropout=False, decode=True,
      max_decode_length=length, task_ids=task_ids, mutable=['cache'],
      method=model.decode)
  initial = cache = variables['cache']

  @jax.jit
  def step(cache, token):
    logits, new = model.apply(
        {'params': params, 'cache': cache}, encoded, enc, token, token,
        enable_dropout=False, decode=True, max_decode_length=length,
        task_ids=step_task_ids, mutable=['cache'], method=model.decode)
    return logits[:, 0], new['cache']

  steps = []
  for i in range(length):
    logits, cache = step(cache, dec_in[:, i:i + 1])
    steps.append(logits)
  return np.stack(steps, 1), initial

