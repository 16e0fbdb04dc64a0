"""Model FLOPs utilisation of the training step, on whatever device JAX runs.

    python -m hyperprompt_jax.benchmark --mfu [--model=t5_1_1_base]
        [--dtype=bfloat16] [--batch_size=32] [--input_length=512]
        [--target_length=32] [--variants=hyperprompt_global,hypergrid_lg,...]
        [--forms=both] [--steps=5] [--warmup_steps=3]
        [--peak_tflops=989] [--output_json=mfu.json]

MTL and each variant of `VARIANTS` (HyperPrompt-Global, HyperGrid-LG, the
Vanilla Adapter, HyperFormer++, Prompt-Tuning, at the papers' settings)
train on synthetic rows, side by side in one process: each variant's step
(`trainer.train_step`, the built-in runner's: forward, backward,
Adafactor) is compiled once, run `warmup_steps` times, then timed
`steps` times, every step on its own (the median is reported). A variant
with two forms (`FORMS`: `T5Config.gradient_form` of the adapters and
packed HyperPrompt, `HyperGridConfig.packed_form` of HyperGrid) is timed in
both (`--forms=both`), in its default (`auto`), or in the forms named
(`--forms=written,grouped`; HyperGrid's TPU kernel, 'pallas', only where
named).

Rows: packed, GLUE + SuperGLUE-like examples (`synthetic_rows`, no
tf.data) first-fit into `batch_size` rows of `input_length` /
`target_length` tokens (at most HyperGrid's MAX_SEGMENTS examples a row),
as training packs them; the report's `rows` says so. Token ids are random
(a step's cost does not depend on them).

Figures per variant: step time and its ratio to MTL's; real tokens per second
(the examples' input and target tokens); model FLOPs per step, XLA's cost
analysis of the compiled step (the numerator: it counts the attention
scores, the optimizer and any recomputation), beside the 6 N D estimate
(`six_nd_flops`); achieved TFLOP/s; MFU against the device's dense bf16
peak (`PEAK_TFLOPS`, or `--peak_tflops`; on a CPU there is none, so MFU is
n/a without it); the step's peak memory as XLA plans it, and the device's
peak so far where it reports one. The JSON (`--output_json`) is rewritten
after each variant, so a run cut short keeps what it measured.

This module imports no TensorFlow, seqio, orbax or gin: a bare accelerator
image with jax, flax and optax runs it (tools/device_benchmark.sh).
"""

import argparse
import collections
import dataclasses
import functools
import glob
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

import hyperprompt_jax
from hyperprompt_jax import files
from hyperprompt_jax import methods
from hyperprompt_jax import paths
from hyperprompt_jax.benchmarks import length_estimates
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.common import gin_literals
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer


def backbone_settings(name: str) -> dict[str, Any]:
  """`network.T5Config`'s settings in gin/models/<name>.gin (read without
  gin), but the activation dtype, which the benchmark sets."""
  size = gin_literals.read(f'models/{name}.gin')['network.T5Config']
  return {k: v for k, v in size.items() if k != 'dtype'}


# Every model size of gin/models/, by file name (e.g. 't5_1_1_base').
BACKBONES = {
    name: backbone_settings(name) for name in sorted(
        os.path.splitext(f)[0]
        for f in os.listdir(os.path.join(paths.gin_dir(), 'models')))}
# Each variant's gin/variants file (MTL: none), read at its settings (the
# papers').
VARIANTS = {
    'mtl': None,
    'hyperprompt_global': 'variants/hyperprompt_global.gin',
    'hypergrid_lg': 'variants/hypergrid_lg.gin',
    'adapter': 'variants/adapter.gin',
    'hyperformer_pp': 'variants/hyperformer_pp.gin',
    'prompt_tuning': 'variants/prompt_tuning.gin',
}
# Variants with two forms, one shaped for XLA:CPU and the plain one: the
# config field that picks them, and the forms (CPU's first; a third, a
# TPU kernel, runs only where `--forms` names it).
FORMS = {
    'hyperprompt_global': ('gradient_form', ('written', 'autodiff')),
    'adapter': ('gradient_form', ('written', 'autodiff')),
    'hyperformer_pp': ('gradient_form', ('written', 'autodiff')),
    'hypergrid_lg': ('packed_form', ('blockwise', 'grouped', 'pallas')),
}
TWO_FORMS = tuple(name for name, (field, _) in FORMS.items()
                  if field == 'gradient_form')
# Forms renamed, old name -> new (`form_names`).
RENAMED_FORMS = hypergrid.RENAMED_PACKED_FORMS

# Dense bf16 TFLOP/s per chip, by a lower-case piece of
# `jax.Device.device_kind` (the first that matches; vendors' datasheets).
PEAK_TFLOPS = (
    ('h200', 989.0),
    ('h100 pcie', 756.0),
    ('h100', 989.0),           # SXM ('NVIDIA H100 80GB HBM3')
    ('a100', 312.0),
    ('tpu v6 lite', 918.0),    # v6e
    ('tpu v6e', 918.0),
    ('tpu v5 lite', 197.0),    # v5e
    ('tpu v5e', 197.0),
    ('tpu v5p', 459.0),
    ('tpu v5', 459.0),         # v5p reports 'TPU v5'
    ('tpu v4', 275.0),
)


def method_settings(variant_file: str) -> dict[str, Any]:
  """The `network.T5Config` settings of a gin/variants file, read without
  gin: its methods' configs at the file's settings, and the task-id space
  of its paper setup (`benchmark.variant_config` builds the same with
  gin)."""
  bindings = gin_literals.read(variant_file)
  task_file = gin_literals.paper_task_file(variant_file)
  settings = {'num_tasks': gin_literals.read(task_file)['network.T5Config'][
      'num_tasks']}
  for method in methods.REGISTRY:
    reference = bindings.get('network.T5Config', {}).get(method.CONFIG_FIELD)
    if reference is not None:
      config_class = getattr(method, reference.name.rsplit('.', 1)[1])
      settings[method.CONFIG_FIELD] = config_class(
          **bindings.get(reference.name, {}))
  return settings


def model_config(backbone: str, variant: str, dtype: str = 'bfloat16',
                 form: str = 'auto', num_layers: Optional[int] = None
                 ) -> network.T5Config:
  """The `network.T5Config` of `variant` ('mtl' or a key of `VARIANTS`) on
  `backbone` (a key of `BACKBONES`), activations in `dtype`, in `form`
  for a variant of `FORMS` ('auto': the default), `num_layers` a stack
  (None: the backbone's).

  HyperGrid's grid is cut to divide d_model and d_ff where they are
  smaller than the paper's (t5_1_1_tiny). Traced task ids are not checked
  in the step (`check_traced_task_ids` off: a host callback would sit in
  every step); `synthetic_rows` makes valid ones.
  """
  if backbone not in BACKBONES:
    raise ValueError(f'Unknown model {backbone!r}: choose from '
                     f'{sorted(BACKBONES)}.')
  if variant not in VARIANTS:
    raise ValueError(f'Unknown variant {variant!r} for --mfu: choose from '
                     f'{list(VARIANTS)}.')
  size = BACKBONES[backbone]
  if num_layers is not None:
    if num_layers < 1:
      raise ValueError(f'--num_layers={num_layers}: at least 1 a stack.')
    size = dict(size, num_encoder_layers=num_layers,
                num_decoder_layers=num_layers)
  method = method_settings(VARIANTS[variant]) if VARIANTS[variant] else {}
  if 'hypergrid' in method:  # the grid's blocks must divide a tiny model's
    method['hypergrid'] = dataclasses.replace(
        method['hypergrid'],
        grid_rows=math.gcd(method['hypergrid'].grid_rows, size['emb_dim']),
        grid_cols=math.gcd(method['hypergrid'].grid_cols, size['mlp_dim']))
  gradient_form = 'auto'
  if variant in FORMS and FORMS[variant][0] == 'gradient_form':
    gradient_form = form
  elif variant in FORMS:  # HyperGrid's packed form
    method['hypergrid'] = dataclasses.replace(method['hypergrid'],
                                              packed_form=form)
  return network.T5Config(**size, **method, dtype=dtype,
                          gradient_form=gradient_form,
                          check_traced_task_ids=False)


def synthetic_rows(batch_size: int, input_length: int, target_length: int,
                   vocab_size: int, num_tasks: int, packed: bool,
                   prompt_slots: int = 0, seed: int = 0,
                   max_segments: Optional[int] = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """A batch of `batch_size` rows and its statistics.

  Packed: examples of `length_estimates.sample_glue_super_glue` placed
  first-fit (the first row
  where both the input and the target fit, at most `max_segments` a row),
  until 64 examples in a row fit nowhere; each example's inputs get
  `prompt_slots` reserved positions in front (Prompt-Tuning's). Unpacked:
  the stream's first `batch_size` examples, one a row. Inputs and targets
  longer than a row are cut. A task id is the task's index modulo
  `num_tasks`.

  Returns:
    `(batch, stats)`: the model features (`inputs.required_features`), and
    `real_tokens` (the examples' input and target tokens, slots left out),
    `examples`, `fill` (the share of row positions that hold tokens).
  """
  rng = np.random.default_rng(seed)
  stream = length_estimates.sample_glue_super_glue(
      rng, batch_size * 64 if packed else batch_size)
  examples = [(min(n_in, input_length - prompt_slots if packed
                   else input_length), min(n_out, target_length),
               task % num_tasks) for n_in, n_out, task in stream]
  rows = [[] for _ in range(batch_size)]
  if packed:
    used = np.zeros((batch_size, 2), np.int64)
    misses = 0
    for example in examples:
      need = np.array([example[0] + prompt_slots, example[1]])
      fits = np.all(used + need <= [input_length, target_length], axis=1)
      if max_segments is not None:
        fits &= np.array([len(r) < max_segments for r in rows])
      if not fits.any():
        misses += 1
        if misses >= 64:
          break
        continue
      misses = 0
      row = int(np.argmax(fits))
      rows[row].append(example)
      used[row] += need
  else:
    for row, example in zip(rows, examples):
      row.append(example)
  return _features(rows, input_length, target_length, vocab_size, packed,
                   prompt_slots, rng)


def _features(rows, input_length, target_length, vocab_size, packed,
              prompt_slots, rng):
  """The model features of `rows` (lists of `(inputs, targets, task)`
  lengths) and their statistics (`synthetic_rows`)."""
  b = len(rows)
  enc = np.zeros((b, input_length), np.int32)
  dec_in = np.zeros((b, target_length), np.int32)
  dec_out = np.zeros((b, target_length), np.int32)
  names = ('segment_ids', 'positions', 'task_ids')
  enc_extra = {n: np.zeros((b, input_length), np.int32) for n in names}
  dec_extra = {n: np.zeros((b, target_length), np.int32) for n in names}
  task_ids = np.zeros((b,), np.int32)
  real = 0
  for r, row in enumerate(rows):
    i = j = 0
    for segment, (n_in, n_out, task) in enumerate(row, start=1):
      slots = prompt_slots if packed else 0
      tokens = rng.integers(2, vocab_size, n_in, dtype=np.int32)
      enc[r, i:i + slots + n_in] = np.concatenate(
          [np.full(slots, prompt_tuning.PROMPT_SLOT_TOKEN, np.int32), tokens])
      targets = rng.integers(2, vocab_size, n_out, dtype=np.int32)
      dec_out[r, j:j + n_out] = targets
      dec_in[r, j + 1:j + n_out] = targets[:-1]  # 0 starts each example
      for extra, start, n in ((enc_extra, i, slots + n_in),
                              (dec_extra, j, n_out)):
        extra['segment_ids'][r, start:start + n] = segment
        extra['positions'][r, start:start + n] = np.arange(n)
        extra['task_ids'][r, start:start + n] = task
      task_ids[r] = task
      i, j = i + slots + n_in, j + n_out
      real += n_in + n_out
  batch = {'encoder_input_tokens': enc, 'decoder_input_tokens': dec_in,
           'decoder_target_tokens': dec_out,
           'decoder_loss_weights': (dec_out > 0).astype(np.int32)}
  if packed:
    batch.update({f'encoder_{n}': a for n, a in enc_extra.items()})
    batch.update({f'decoder_{n}': a for n, a in dec_extra.items()})
  else:
    batch['task_ids'] = task_ids
  filled = (enc > 0).sum() + (dec_out > 0).sum()
  stats = {'real_tokens': int(real),
           'examples': int(sum(len(r) for r in rows)),
           'fill': float(filled / (enc.size + dec_out.size))}
  return batch, stats


def peak_tflops(device: jax.Device, override: Optional[float] = None
                ) -> Optional[float]:
  """The device's dense bf16 TFLOP/s (`PEAK_TFLOPS`), `override` if given;
  None where the table has no entry (a CPU)."""
  if override is not None:
    return override
  kind = device.device_kind.lower()
  for piece, tflops in PEAK_TFLOPS:
    if piece in kind:
      return tflops
  return None


def xla_flops(compiled) -> Optional[float]:
  """FLOPs of a compiled computation by XLA's cost analysis (None where the
  backend gives none)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else None
  if not cost or 'flops' not in cost:
    return None
  return float(cost['flops'])


def six_nd_flops(params: Any, batch: dict[str, np.ndarray]) -> float:
  """The 6 N D estimate of a training step's FLOPs, of the T5 backbone: 6 x
  (the encoder's backbone parameters x encoder positions + the decoder's,
  its output layer included, x decoder positions). Every position of the
  rows counts (the step computes padding too); the token embedding (a
  gather) and the task-conditioned parameters (`param_groups`: generated
  or selected per task, not applied to every token as they are) do not.
  It leaves out the attention scores, which XLA's count has."""
  rows, input_length = batch['encoder_input_tokens'].shape
  target_length = batch['decoder_target_tokens'].shape[1]
  counts = {'encoder': 0, 'decoder': 0}
  for path, leaf in traverse_util.flatten_dict(params, sep='/').items():
    stack = path.split('/')[0]
    if stack in counts and not param_groups.is_task_conditioned(path):
      counts[stack] += math.prod(leaf.shape)
  return 6.0 * rows * (counts['encoder'] * input_length
                       + counts['decoder'] * target_length)


def device_peak_bytes(device: jax.Device) -> Optional[int]:
  """The device's peak bytes in use so far, where it reports them."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return (stats or {}).get('peak_bytes_in_use')


def measure(cfg: network.T5Config, batch: dict[str, np.ndarray],
            warmup_steps: int, steps: int,
            profile_dir: Optional[str] = None) -> dict[str, Any]:
  """One model's training step on `batch`: compiled once, run
  `warmup_steps` times, then `steps` steps timed one by one; with
  `profile_dir`, two more steps are traced there, their device time summed
  by XLA op (`kernel_times`), and the compiled module's text written beside
  the trace (`step.hlo.txt`: the trace names the optimized module's ops)."""
  model = network.Transformer(cfg)
  optimizer = optimizers.make_optimizer()
  input_length = batch['encoder_input_tokens'].shape[1]
  target_length = batch['decoder_target_tokens'].shape[1]
  state = timing.fresh_state(model, optimizer, input_length, target_length)
  batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()})
  start = time.perf_counter()
  step = jax.jit(functools.partial(trainer.train_step, model, optimizer,
                                   z_loss=timing.Z_LOSS),
                 donate_argnums=(0,))
  compiled = step.lower(state, batch, jax.random.PRNGKey(0)).compile()
  compile_seconds = time.perf_counter() - start
  estimate = six_nd_flops(state['params'], batch)
  times = []
  for i in range(warmup_steps + steps):
    start = time.perf_counter()
    state, terms = compiled(state, batch, jax.random.PRNGKey(i))
    jax.block_until_ready((state, terms))
    if i >= warmup_steps:
      times.append(time.perf_counter() - start)
  row = {'seconds_per_step': statistics.median(times),
         'step_seconds': times, 'compile_seconds': compile_seconds,
         'xla_flops': xla_flops(compiled), 'six_nd_flops': estimate,
         'xla_peak_bytes': timing.peak_bytes(compiled),
         'loss': float(terms['loss'])}
  if profile_dir:
    with jax.profiler.trace(profile_dir):
      for i in range(2):
        state, terms = compiled(state, batch, jax.random.PRNGKey(100 + i))
      jax.block_until_ready((state, terms))
    row['kernel_times'] = kernel_times(profile_dir, steps=2)
    with open(os.path.join(profile_dir, 'step.hlo.txt'), 'w') as f:
      f.write(compiled.as_text())
  del state
  return row


def kernel_times(profile_dir: str, steps: int, top: int = 25
                 ) -> Optional[dict[str, Any]]:
  """The device time of a trace in `profile_dir`, per step: in total, and
  the `top` XLA ops (the device plane's 'XLA Ops' line) and kernels (its
  stream lines) by their summed time, `[name, ms, count]` each. None where
  the trace has no device plane (a CPU's)."""
  files = sorted(glob.glob(os.path.join(profile_dir, '**', '*.xplane.pb'),
                           recursive=True))
  if not files:
    return None
  data = jax.profiler.ProfileData.from_file(files[-1])
  ops, kernels = collections.Counter(), collections.Counter()
  op_count, kernel_count = collections.Counter(), collections.Counter()
  for plane in data.planes:
    if not plane.name.startswith('/device:'):
      continue
    for line in plane.lines:
      if line.name == 'XLA Ops':
        totals, counts = ops, op_count
      elif line.name.startswith('Stream'):
        totals, counts = kernels, kernel_count
      else:
        continue
      for event in line.events:
        totals[event.name] += event.duration_ns
        counts[event.name] += 1
  if not ops and not kernels:
    return None
  per_step = lambda ns: ns / 1e6 / steps
  table = lambda c, n: [[name, per_step(ns), n[name] // steps]
                        for name, ns in c.most_common(top)]
  return {'ops_ms': per_step(sum(ops.values())),
          'kernels_ms': per_step(sum(kernels.values())),
          'top_ops': table(ops, op_count),
          'top_kernels': table(kernels, kernel_count)}


def form_names(flag: str) -> str:
  """A --forms value with old form names (`RENAMED_FORMS`) renamed, each
  with a DeprecationWarning and a line on stderr."""
  names = []
  for name in flag.split(','):
    if name in RENAMED_FORMS:
      hyperprompt_jax.warn_renamed(
          f"--forms: '{name}' is now '{RENAMED_FORMS[name]}'")
      name = RENAMED_FORMS[name]
    names.append(name)
  return ','.join(names)


def runs(variants: Sequence[str], forms: str) -> list[tuple[str, str]]:
  """`(variant, form)` in the order they run, MTL first: both forms of a
  variant of `FORMS` (`forms='both'`), its default ('auto'), or those of
  its forms that the comma-separated `forms` names (its default where it
  names none of them)."""
  named = set(forms.split(','))
  runs = []
  for name in ['mtl', *[v for v in variants if v != 'mtl']]:
    own = FORMS[name][1] if name in FORMS else ()
    if forms == 'both' and own:
      chosen = own[:2]
    else:
      chosen = tuple(f for f in own if f in named) or ('auto',)
    runs.extend((name, form) for form in chosen)
  return runs


def label_of(variant: str, form: str) -> str:
  """A variant's name in the tables: with its form where one is named."""
  return variant if form == 'auto' else f'{variant} [{form}]'


def mfu_benchmark(backbone: str, variants: Sequence[str], dtype: str,
                  batch_size: int, input_length: int, target_length: int,
                  warmup_steps: int, steps: int,
                  peak: Optional[float] = None,
                  forms: str = 'both',
                  output_json: Optional[str] = None,
                  log=print, profile: Sequence[str] = (),
                  profile_dir: Optional[str] = None,
                  num_layers: Optional[int] = None) -> dict[str, Any]:
  """Every variant's figures (module docstring), the JSON's content; the
  variants named in `profile` (or 'all') are traced into `profile_dir` after
  timing and their device time broken down by op; `num_layers` a stack
  (None: the backbone's)."""
  device = jax.devices()[0]
  tflops_peak = peak_tflops(device, peak)
  report = {
      'device': device.device_kind, 'platform': device.platform,
      'devices': jax.device_count(), 'jax': jax.__version__,
      'model': backbone, 'dtype': dtype, 'batch_size': batch_size,
      'input_length': input_length, 'target_length': target_length,
      'warmup_steps': warmup_steps, 'steps': steps,
      'peak_tflops': tflops_peak, 'rows': []}
  if num_layers is not None:  # a smaller model than the backbone's
    report['num_layers'] = num_layers
  log(f'device: {device.device_kind} ({device.platform}, '
      f'{jax.device_count()} devices; the step runs on one), jax '
      f'{jax.__version__}; peak {tflops_peak} TFLOP/s bf16')
  for name, form in runs(variants, forms):
    cfg = model_config(backbone, name, dtype, form, num_layers)
    packed = True  # every variant packs (`synthetic_rows` can do without)
    slots = prompt_tuning.prompt_length(cfg.prompt_tuning)
    batch, stats = synthetic_rows(batch_size, input_length, target_length,
                                  cfg.vocab_size, cfg.num_tasks, packed,
                                  slots, max_segments=hypergrid.max_segments(
                                      cfg.hypergrid))
    label = label_of(name, form)
    log(f'{time.strftime("%H:%M:%S")} {label}: compiling '
        f'({"packed" if packed else "unpacked"} rows)')
    trace = (os.path.join(profile_dir, f'{name}_{form}')
             if profile_dir and ('all' in profile or name in profile)
             else None)
    # Each variant is timed before the next compiles: a run cut short (the
    # device script's timeout) keeps every variant it reached, and no
    # compilation autotunes kernels on the device while a step is timed.
    row = measure(cfg, batch, warmup_steps, steps, trace)
    seconds = row['seconds_per_step']
    flops = row['xla_flops'] or row['six_nd_flops']
    row.update({
        'variant': name, 'form': form, 'label': label,
        'rows': 'packed' if packed else 'unpacked', **stats,
        'real_tokens_per_second': stats['real_tokens'] / seconds,
        'tflops_per_second': flops / seconds / 1e12,
        'mfu': (flops / seconds / (tflops_peak * 1e12)
                if tflops_peak else None),
        'six_nd_mfu': (row['six_nd_flops'] / seconds / (tflops_peak * 1e12)
                       if tflops_peak else None),
        'device_peak_bytes': device_peak_bytes(device)})
    mtl = report['rows'][0]['seconds_per_step'] if report['rows'] else seconds
    row['ratio_to_mtl'] = seconds / mtl
    report['rows'].append(row)
    log(f'{time.strftime("%H:%M:%S")} {label}: compiled in '
        f'{row["compile_seconds"]:.1f} s, {1000 * seconds:.1f} ms/step, '
        f'MFU {_percent(row["mfu"])} (6ND {_percent(row["six_nd_mfu"])})')
    if row.get('kernel_times'):
      log(format_kernel_times(label, row['kernel_times']))
    if output_json:
      _write_json(output_json, report)
  return report


def format_kernel_times(label: str, times: dict[str, Any]) -> str:
  """`kernel_times`' tables, for the log."""
  lines = [f'{label}: device time per step {times["ops_ms"]:.1f} ms in XLA '
           f'ops, {times["kernels_ms"]:.1f} ms in kernels']
  for title, key in (('XLA op', 'top_ops'), ('kernel', 'top_kernels')):
    lines.append(f'  {"ms":>8} {"calls":>6}  {title}')
    lines.extend(f'  {ms:>8.2f} {count:>6}  {name[:110]}'
                 for name, ms, count in times[key])
  return '\n'.join(lines)


def _percent(x: Optional[float]) -> str:
  return 'n/a' if x is None else f'{100 * x:.1f}%'


def _write_json(path: str, report: dict) -> None:
  files.write_atomically(path, json.dumps(report, indent=1))


def format_report(report: dict) -> str:
  """The table of `mfu_benchmark`'s rows."""
  layers = (f' (--num_layers={report["num_layers"]})'
            if 'num_layers' in report else '')
  lines = [f'{report["model"]}{layers}, {report["dtype"]} activations, batch '
           f'{report["batch_size"]} rows of {report["input_length"]} / '
           f'{report["target_length"]}, {report["steps"]} timed steps after '
           f'{report["warmup_steps"]}; {report["device"]}, jax '
           f'{report["jax"]}',
           f'{"variant":<30}{"rows":<9}{"ms/step":>9}{"x MTL":>7}'
           f'{"real tok/s":>12}{"XLA TFLOP":>10}{"6ND TFLOP":>10}'
           f'{"TFLOP/s":>9}{"MFU":>7}{"peak GiB":>9}']
  for r in report['rows']:
    xla = r['xla_flops']
    lines.append(
        f'{r["label"]:<30}{r["rows"]:<9}{1000 * r["seconds_per_step"]:>9.1f}'
        f'{r["ratio_to_mtl"]:>6.3f}x{r["real_tokens_per_second"]:>12,.0f}'
        f'{"n/a" if xla is None else f"{xla / 1e12:.2f}":>10}'
        f'{r["six_nd_flops"] / 1e12:>10.2f}{r["tflops_per_second"]:>9.1f}'
        f'{_percent(r["mfu"]):>7}{r["xla_peak_bytes"] / 2**30:>9.2f}')
  if report['peak_tflops'] is None:
    lines.append('MFU: n/a, no peak for this device: pass --peak_tflops '
                 '(its dense bf16 TFLOP/s).')
  return '\n'.join(lines)


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.benchmark --mfu` with its parsed flags."""
  variants = (list(VARIANTS) if args.variants is None
              else methods.variant_names(args.variants))
  bad = sorted(set(variants) - set(VARIANTS))
  if bad:
    raise ValueError(f'Unknown variants {bad} for --mfu: choose from '
                     f'{list(VARIANTS)}.')
  args.forms = form_names(args.forms)
  known = {'both', 'auto', *(f for _, fs in FORMS.values() for f in fs)}
  if not set(args.forms.split(',')) <= known:
    raise ValueError(f'--forms={args.forms}: choose from both, auto, or '
                     f'forms among {sorted(known - {"both", "auto"})}.')
  if args.batch_size <= 0 or args.steps <= 0 or args.warmup_steps < 0:
    raise ValueError('--batch_size and --steps must be positive, '
                     '--warmup_steps >= 0.')
  profile = [v for v in (args.profile or '').split(',') if v]
  bad = sorted(set(profile) - set(VARIANTS) - {'all'})
  if bad:
    raise ValueError(f'Unknown variants {bad} for --profile: choose from '
                     f'{["all", *VARIANTS]}.')
  profile_dir = args.profile_dir or (
      os.path.join(os.path.dirname(args.output_json) or '.', 'profiles')
      if args.output_json else os.path.join('.', 'mfu_profiles'))
  report = mfu_benchmark(
      args.model, variants, args.dtype, args.batch_size, args.input_length,
      args.target_length, args.warmup_steps, args.steps, args.peak_tflops,
      args.forms, args.output_json,
      log=lambda line: print(line, flush=True),
      profile=profile, profile_dir=profile_dir if profile else None,
      num_layers=args.num_layers)
  print(format_report(report))
  if args.output_json:
    print(f'JSON: {args.output_json}')
  sys.stdout.flush()
  return 0
