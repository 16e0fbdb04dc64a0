r"""A run's training step and decode compiled for a TPU slice, on a CPU host.

    python -m hyperprompt_jax.benchmark --tpu_compile --topology=v3:4x4 \
        --gin_file=runs/hypergrid_lg_glue_super_glue.gin \
        [--gin.MESH_MODEL=2] [--gin.NUM_MICROBATCHES=2] \
        [--gin.REMAT_POLICY="'full'"] [--output_json=tpu.json]
    python -m hyperprompt_jax.benchmark --tpu_compile --topology=v5e:2x2 \
        --model=t5_1_1_base --variants=mtl,hyperprompt_global,hypergrid_lg --forms=auto \
        --batch_size=128 [--mesh_model=1] [--num_microbatches=1]
    python -m hyperprompt_jax.benchmark --tpu_compile --topology=v3-32 \
        --gin_file=t5x/hypergrid_lg_glue_super_glue.gin [--gin.X=Y ...]

`--topology` is a gcloud accelerator type (`v3-32`, `v4-16`, `v5p-64`,
`v5litepod-16` / `v5e-16`, `v6e-64`) or a `jax.experimental.topologies`
name (`hyperprompt_jax.tpu.slices`).

libtpu (`pip install -e '.[tpu]'`) holds the TPU compiler, and
`jax.experimental.topologies` gives the devices of any slice
(`v3:4x4`, `v5e:16x16`, `v5p:4x4x4`, ...) with no TPU attached, so
`jit(step).lower(shapes).compile()` builds the program each chip of the slice
would run. Nothing is allocated and no data is read.

With `--gin_file` of a t5x run file (gin/t5x/, which includes t5x's run
configuration: `t5x_script`), t5x's own train, eval and predict steps are
compiled, as t5x.train builds them from the file
(`hyperprompt_jax.t5x.steps_compile`, which needs t5x). With a built-in run file
(runs/), the setup is the run's: its gin files are parsed as
`python -m hyperprompt_jax.train` parses them, and the mesh (MESH_DATA x
MESH_MODEL over the slice's devices), the model (REMAT_POLICY and every
method setting), the optimizer (`make_optimizer` as bound, frozen embeddings
included), NUM_MICROBATCHES, MetaBalance (GRADIENT_BALANCING and its
settings), the rows (PACK, TASK_FEATURE_LENGTHS, BATCH_SIZE) and the
decode's batch (EVAL_BATCH_SIZE) are the run's. The state and the batch are
placed as the built-in runner places them (`trainer.Trainer`: parameters by
their logical axes, the optimizer state where the compiler puts
`optimizer.init`'s outputs) and its step (`Trainer.step_function`, checked
on the host) is compiled, then the evaluator's greedy decode
(`predictor.Predictor`). The gin files import the task registry (seqio,
TensorFlow) as the run's do.

Without `--gin_file`, the setups are the MFU benchmark's variants
(`mfu.VARIANTS` at `--model`'s size, `mfu.model_config`), packed rows of
`--batch_size` at `--input_length` / `--target_length`; this path imports no
gin, TensorFlow or seqio.

Figures per program, for one device (the SPMD program every device runs;
on TPU v2 / v3, whose chips show their two TensorCores as two devices,
`per_chip` too), as `hyperprompt_jax.tpu.program_figures` reads them from
XLA: memory against the HBM, FLOPs and bytes accessed, collectives, large
scatters and gathers, loops, host callbacks; for the training step also the
FLOPs of every chip over 6 N D (`mfu.six_nd_flops` of the global batch).
The JSON (`--output_json`) holds them all and is rewritten after each
setup, so a run cut short keeps what it compiled; each optimized module's
text is written beside it (`<json>_hlo/<setup>.<program>.hlo.txt`).
"""

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from hyperprompt_jax import files
from hyperprompt_jax import methods
from hyperprompt_jax import paths
from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import inputs
from hyperprompt_jax.tpu import program_figures
from hyperprompt_jax.tpu import slices
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer as trainer_lib


@dataclasses.dataclass
class Setup:
  """What one compile needs: the network, the optimizer, the mesh's axes,
  the rows and the step's settings (a run's, or an MFU model's)."""
  name: str
  config: network.T5Config
  input_length: int
  target_length: int
  batch_size: int
  pack: bool = True
  mesh_data: int = -1
  mesh_model: int = 1
  num_microbatches: Optional[int] = None
  eval_batch_size: Optional[int] = None  # None: no decode
  optimizer: Any = None  # None: `optimizers.make_optimizer()`
  z_loss: float = timing.Z_LOSS  # the MFU benchmark's
  balancing: Any = None  # a `metabalance.Plan`, or None
  label: str = ''  # what the setup's settings are, for the table

  @property
  def lengths(self) -> dict[str, int]:
    return {'inputs': self.input_length, 'targets': self.target_length}


def setup_gin_files(name: str) -> list[str]:
  """The gin files of a setup name: `<run>` is `runs/<run>.gin`;
  `<run>+<file>[+<file>...]` adds gin files after it, as `--gin_file` would
  (`hyperprompt_global_glue+models/t5_1_1_large`: the run at Large, the
  setup files' documented way to change the model size)."""
  run, *extra = name.split('+')
  if not run or not all(extra):
    raise ValueError(f'Setup {name!r}: expected <run>[+<gin file>...], e.g. '
                     'hyperprompt_global_glue+models/t5_1_1_large.')
  return [f'runs/{run}.gin'] + [
      f if f.endswith('.gin') else f'{f}.gin' for f in extra]


def placed_batch(features: Sequence[str], rows: int, lengths: dict[str, int],
                 sharding: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes of a model batch of `rows` rows (int32), split by
  `sharding` (None: unplaced)."""
  def shape(name):
    if name == 'task_ids':
      return (rows,)
    return (rows, lengths['targets' if name.startswith('decoder')
                          else 'inputs'])
  return {name: jax.ShapeDtypeStruct(shape(name), jnp.int32,
                                     sharding=sharding) for name in features}


def compile_train(setup: Setup, mesh: jax.sharding.Mesh,
                  hbm_bytes: Optional[int], hlo_path: Optional[str] = None
                  ) -> dict[str, Any]:
  """The built-in runner's training step of `setup` on `mesh`."""
  model = network.Transformer(setup.config)
  trainer = trainer_lib.Trainer(
      model, setup.optimizer or optimizers.make_optimizer(), mesh,
      setup.lengths, z_loss=setup.z_loss, balancing=setup.balancing,
      num_microbatches=setup.num_microbatches, checked_on_host=True)
  batch = placed_batch(inputs.required_features(setup.pack),
                       setup.batch_size, setup.lengths, trainer.batch_sharding)
  state = trainer.abstract_state()
  abstract = network.abstract_variables(model, setup.input_length,
                                        setup.target_length)
  # The state's parameters: args[0]['params'].
  axes = program_figures.param_axes_by_path(
      abstract['params_axes'],
      (jax.tree_util.SequenceKey(0), jax.tree_util.DictKey('params')))
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = trainer.step_function().lower(state, batch).compile()
  out = program_figures.figures(compiled, time.perf_counter() - start,
                                hbm_bytes, (state, batch), axes, hlo_path)
  six_nd = mfu.six_nd_flops(trainer.abstract_params, batch)
  out['six_nd_flops'] = six_nd
  out['flops_over_6nd'] = (out['flops'] * mesh.size / six_nd
                           if out['flops'] else None)
  out['parameters'] = sum(math.prod(a.shape) for a in
                          jax.tree.leaves(trainer.abstract_params))
  return out


def compile_decode(setup: Setup, mesh: jax.sharding.Mesh,
                   hbm_bytes: Optional[int], hlo_path: Optional[str] = None
                   ) -> dict[str, Any]:
  """The evaluator's greedy decode (`predictor.Predictor`) of
  `setup.eval_batch_size` unpacked rows."""
  from hyperprompt_jax.evaluation import predictor as predictor_lib  # pylint: disable=g-import-not-at-top
  model = network.Transformer(setup.config)
  abstract = network.abstract_variables(model)
  predictor = predictor_lib.Predictor(
      model, abstract['params_axes'], mesh, batch_size=setup.eval_batch_size,
      max_decode_length=setup.target_length)
  params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract['params'], predictor.param_shardings)
  batch = placed_batch(('encoder_input_tokens', 'task_ids'),
                       setup.eval_batch_size, setup.lengths,
                       predictor.batch_sharding)
  args = (params, batch['encoder_input_tokens'], batch['task_ids'])
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = predictor.decode_function().lower(*args).compile()
  axes = program_figures.param_axes_by_path(abstract['params_axes'],
                                            (jax.tree_util.SequenceKey(0),))
  return program_figures.figures(compiled, time.perf_counter() - start,
                                 hbm_bytes, args, axes, hlo_path)


def compile_setup(setup: Setup, devices: Sequence[jax.Device],
                  log: Callable[[str], None] = lambda _: None,
                  hlo_dir: Optional[str] = None) -> dict[str, Any]:
  """Compiles `setup`'s training step (and decode) for `devices`; a program
  that does not compile gets its error instead of figures. Each optimized
  module's text goes to `hlo_dir/<setup> [<label>].<program>.hlo.txt`."""
  mesh = partitioning.create_mesh(setup.mesh_data, setup.mesh_model,
                                  devices=devices)
  hbm = slices.device_hbm_bytes(devices)
  cores = slices.devices_per_chip(devices)
  report = {'setup': setup.name, 'label': setup.label,
            'mesh': dict(mesh.shape), 'batch_size': setup.batch_size,
            'lengths': setup.lengths, 'pack': setup.pack,
            'num_microbatches': setup.num_microbatches or 1,
            'remat_policy': setup.config.remat_policy,
            'metabalance': None if setup.balancing is None else {
                'auxiliaries': setup.balancing.settings.auxiliaries,
                'num_auxiliary': setup.balancing.num_auxiliary},
            'programs': {}}
  if setup.batch_size % mesh.shape['data']:
    raise ValueError(f'{setup.name}: BATCH_SIZE={setup.batch_size} does not '
                     f"divide over the mesh's {mesh.shape['data']} data "
                     'shards.')
  trainer_lib.check_num_microbatches(setup.num_microbatches,
                                     setup.batch_size // mesh.shape['data'])
  programs = [('train', compile_train)]
  if setup.eval_batch_size:
    programs.append(('decode', compile_decode))
  for kind, build in programs:
    hlo_path = hlo_file(hlo_dir, setup.name + (
        f' {setup.label}' if setup.label else ''), kind)
    try:
      report['programs'][kind] = build(setup, mesh, hbm, hlo_path)
      if cores > 1:
        report['programs'][kind]['per_chip'] = program_figures.per_chip(
            report['programs'][kind], cores)
    except Exception as e:  # pylint: disable=broad-except
      report['programs'][kind] = {'error': f'{type(e).__name__}: {e}'[:2000]}
    log(format_program(setup.name, kind, report['programs'][kind]))
  return report


def hlo_file(hlo_dir: Optional[str], name: str, kind: str) -> Optional[str]:
  """Where a program's optimized module goes: `hlo_dir/<name>.<kind>.hlo.txt`
  (None without `hlo_dir`)."""
  if not hlo_dir:
    return None
  return os.path.join(hlo_dir, re.sub(r'[^\w.+=,-]+', '_', name)
                      + f'.{kind}.hlo.txt')


def format_program(name: str, kind: str, p: dict[str, Any]) -> str:
  """One line of a program's figures: memory per device, and per chip
  where a chip shows several devices (`per_chip`: TPU v2 / v3's
  TensorCores)."""
  if 'error' in p:
    return f'{name} {kind}: does not compile: {p["error"][:300]}'
  m = p['memory']
  fit = '' if p['fits'] is None else (
      f' of {p["hbm_bytes"] / slices.GIB:.0f} GiB '
      f'({"fits" if p["fits"] else "DOES NOT FIT"})')
  chip = p.get('per_chip')
  if chip:
    fit += (f' per device (TensorCore); per chip ({chip["devices"]} '
            f'TensorCores) {chip["total"] / slices.GIB:.2f} GiB'
            + ('' if chip['hbm_bytes'] is None
               else f' of {chip["hbm_bytes"] / slices.GIB:.0f} GiB')
            + f' (arguments {chip["argument"] / slices.GIB:.2f}, temporaries '
            f'{chip["temp"] / slices.GIB:.2f})')
  collectives = ', '.join(f'{k} {v["count"]} ({v["bytes"] / 1e6:.0f} MB)'
                          for k, v in sorted(p['collectives'].items()))
  ratio = p.get('flops_over_6nd')
  return (f'{name} {kind}: {m["total"] / slices.GIB:.2f} GiB{fit}: arguments '
          f'{m["argument"] / slices.GIB:.2f}, '
          f'temporaries {m["temp"] / slices.GIB:.2f}, '
          f'outputs {m["output"] / slices.GIB:.2f}, '
          f'aliased {m["alias"] / slices.GIB:.2f}; '
          f'{(p["flops"] or 0) / 1e12:.3f} TFLOP'
          + (f' ({ratio:.2f}x 6ND)' if ratio else '')
          + f', {(p["bytes_accessed"] or 0) / 1e9:.1f} GB accessed; '
          f'scatters {p["scatters"]}, gathers {p["gathers"]}, loops '
          f'{p["loops"]}; collectives: {collectives or "none"}; '
          f'host callbacks {len(p["host_callbacks"])}; compiled in '
          f'{p["compile_s"]:.0f} s')


def format_table(report: dict[str, Any]) -> str:
  """The setups' training steps side by side (per chip), each against the
  first setup's."""
  names = [r['setup'] + (f' [{r["label"]}]' if r['label'] else '')
           for r in report['setups']]
  width = max([len(n) for n in names] + [5]) + 2
  lines = [format_slice(report['slice']),
           f'{"setup":<{width}}{"mesh":>7}{"rows":>6}{"GiB":>7}{"temp":>7}'
           f'{"TFLOP":>8}{"x":>7}{"GB acc":>8}{"x":>7}{"temp x":>7}'
           f'{"6ND x":>7}{"fits":>6}']
  first = None

  def ratio(p, key):
    return p[key] / first[key] if first[key] else float('nan')

  for name, r in zip(names, report['setups']):
    p = r['programs'].get('train', {})
    mesh = f'{r["mesh"]["data"]}x{r["mesh"]["model"]}'
    if 'error' in p or not p:
      lines.append(f'{name:<{width}}{mesh:>7}  does not compile')
      continue
    first = first or p
    temp = (p['memory']['temp'] / first['memory']['temp']
            if first['memory']['temp'] >= program_figures.LARGE_BYTES
            else float('nan'))
    fits = '' if p['fits'] is None else ('yes' if p['fits'] else 'NO')
    lines.append(
        f'{name:<{width}}{mesh:>7}{r["batch_size"]:>6}'
        f'{p["memory"]["total"] / slices.GIB:>7.2f}'
        f'{p["memory"]["temp"] / slices.GIB:>7.2f}'
        f'{p["flops"] / 1e12:>8.2f}{ratio(p, "flops"):>6.3f}x'
        f'{p["bytes_accessed"] / 1e9:>8.1f}'
        f'{ratio(p, "bytes_accessed"):>6.2f}x'
        f'{temp:>6.2f}x{p["flops_over_6nd"]:>7.2f}{fits:>6}')
  return '\n'.join(lines)


def format_slice(header: dict[str, Any]) -> str:
  """The slice as given and as mapped, its chips and devices, and HBM a
  device and a chip (`slice_header`)."""
  given = (header['given'] if header['given'] == header['topology']
           else f'{header["given"]} = {header["topology"]}')
  hbm = header['hbm_bytes_per_device']
  if header['devices_per_chip'] > 1:
    return (f'{given}: {header["chips"]} chips, {header["devices"]} devices '
            f'({header["devices_per_chip"]} TensorCores a chip, each a '
            f'device) of kind {header["device_kind"]}; '
            + (f'{hbm / slices.GIB:.1f} GiB HBM per device (TensorCore), '
               f'{header["hbm_bytes_per_chip"] / slices.GIB:.1f} GiB per chip; '
               if hbm else 'HBM unknown; ')
            + 'the figures are per device unless marked per chip')
  return (f'{given}: {header["chips"]} chips, {header["devices"]} devices '
          f'(one a chip) of kind {header["device_kind"]}; '
          + (f'{hbm / slices.GIB:.1f} GiB HBM per chip' if hbm
             else 'HBM unknown'))


def compile_report(topology: str, setups: Sequence[Any],
                   output_json: Optional[str] = None,
                   log: Callable[[str], None] = print,
                   compile_fn: Callable[..., dict[str, Any]] = compile_setup
                   ) -> dict[str, Any]:
  """Compiles every setup for `topology` (`parse_slice`'s forms) with
  `compile_fn(setup, devices, log, hlo_dir)` (the built-in runner's:
  `compile_setup`); the JSON is rewritten after each, the optimized
  modules written beside it (`<json>_hlo/`)."""
  hlo_dir = (os.path.splitext(output_json)[0] + '_hlo' if output_json
             else None)
  devices = slices.topology_devices(topology)
  header = slices.slice_header(topology, devices)
  log(format_slice(header))
  report = {'topology': header['topology'], 'slice': header,
            'devices': len(devices), 'device_kind': devices[0].device_kind,
            'hbm_bytes': slices.device_hbm_bytes(devices),
            'jax': jax.__version__,
            'setups': []}
  for setup in setups:
    report['setups'].append(compile_fn(setup, devices, log, hlo_dir))
    if output_json:
      files.write_atomically(output_json, json.dumps(report, indent=1))
  return report


def model_setups(backbone: str, variants: Sequence[str], forms: str,
                 dtype: str, batch_size: int, input_length: int,
                 target_length: int, mesh_model: int = 1,
                 num_microbatches: Optional[int] = None,
                 eval_batch_size: Optional[int] = None,
                 num_layers: Optional[int] = None) -> list[Setup]:
  """The MFU benchmark's variants (`mfu.VARIANTS`) as setups: packed
  rows, MTL first (the tables' reference); `num_layers` a stack (None: the
  backbone's)."""
  variants = ['mtl'] + [v for v in variants if v != 'mtl']
  return [Setup(name=mfu.label_of(variant, form), config=mfu.model_config(
                    backbone, variant, dtype, form, num_layers),
                input_length=input_length, target_length=target_length,
                batch_size=batch_size, mesh_model=mesh_model,
                num_microbatches=num_microbatches,
                eval_batch_size=eval_batch_size)
          for variant, form in mfu.runs(variants, forms)]


def run_models(args) -> int:
  """`--tpu_compile` without gin: the MFU benchmark's variants."""
  variants = (list(mfu.VARIANTS) if args.variants is None
              else methods.variant_names(args.variants))
  bad = sorted(set(variants) - set(mfu.VARIANTS))
  if bad:
    raise ValueError(f'Unknown variants {bad} for --tpu_compile: choose from '
                     f'{list(mfu.VARIANTS)}.')
  setups = model_setups(
      args.model, variants, mfu.form_names(args.forms), args.dtype,
      args.batch_size, args.input_length, args.target_length, args.mesh_model,
      args.num_microbatches, args.eval_batch_size, args.num_layers)
  return print_report(compile_report(args.topology, setups, args.output_json,
                               log=lambda s: print(s, flush=True)),
                args.output_json)


def check_t5x_run(args, search: Sequence[str]) -> None:
  """Raises ValueError unless `--gin_file` is a t5x.train run file that
  `hyperprompt_jax.t5x.steps_compile` can compile here (t5x installed), naming
  the fix."""
  script = t5x_script(args.gin_file, search)
  first = args.gin_file[0]
  if script != 'train':
    raise ValueError(
        f'--gin_file={first} is a t5x.{script} run file; the compile '
        'command sizes a t5x.train run: give its run file (e.g. '
        '--gin_file=t5x/hyperprompt_global_glue.gin), which compiles the '
        'eval and predict steps too.')
  if importlib.util.find_spec('t5x') is None:
    # The built-in run file of the same setup: runs/<name>.gin
    # (t5x/<name>_train.gin for the quickstarts).
    stem = os.path.splitext(os.path.basename(first))[0]
    builtin = next((f'runs/{s}.gin' for s in (stem, stem.removesuffix(
        '_train')) if os.path.exists(os.path.join(paths.gin_dir(), 'runs',
                                                  f'{s}.gin'))), None)
    equivalent = (f"the built-in runner's equivalent: --gin_file={builtin}"
                  if builtin else 'a built-in run file of runs/ instead')
    raise ValueError(
        f'--gin_file={first} is a t5x run file, and t5x is not installed '
        'here: install it beside this package (docs/t5x.md), or compile '
        f'{equivalent}.')


def print_report(report: dict[str, Any], output_json: Optional[str]) -> int:
  print(format_table(report))
  if output_json:
    print(f'JSON: {output_json}')
  sys.stdout.flush()
  return 0


def _settings_label(setup: Setup) -> str:
  """The settings that change a step's memory, where not the default."""
  parts = []
  if setup.mesh_model != 1:
    parts.append(f'MESH_MODEL={setup.mesh_model}')
  if (setup.num_microbatches or 1) > 1:
    parts.append(f'NUM_MICROBATCHES={setup.num_microbatches}')
  if setup.config.remat_policy != 'none':
    parts.append(f'REMAT_POLICY={setup.config.remat_policy}')
  if setup.balancing is not None:  # 'all' sums the auxiliaries as one
    each = setup.balancing.settings.auxiliaries == 'each'
    parts.append(f"MetaBalance {setup.balancing.settings.auxiliaries}"
                 + (f' K={setup.balancing.num_auxiliary}' if each else ''))
  if not setup.pack:
    parts.append('unpacked')
  return ', '.join(parts)


def gin_setup(name: str, gin_files: Sequence[str],
              bindings: Sequence[str] = (),
              search_paths: Sequence[str] = ()) -> Setup:
  """The setup of a run's gin files and bindings: the network and the
  `RunSettings` that `python -m hyperprompt_jax.train` makes of them, and
  its MetaBalance plan as the loop makes it. gin is cleared before and
  after."""
  import gin  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.training import metabalance_plan  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.training import run_settings  # pylint: disable=g-import-not-at-top

  gin.clear_config()
  try:
    gin_utils.parse_gin(gin_files, bindings, search_paths)
    model = gin.get_configurable(network.Transformer)()
    # A compile writes nothing and reads no checkpoint (COMPILE_ONLY).
    settings = gin.get_configurable(run_settings.RunSettings)(
        model_dir=run_settings.COMPILE_ONLY)
    setup = settings_setup(name, model, settings,
                           metabalance_plan.settings_plan(settings, model))
  finally:
    gin.clear_config()
  return setup


def settings_setup(name: str, model: network.Transformer, settings: Any,
                   plan: Any = None) -> Setup:
  """The setup of a built-in run: its network, its `RunSettings` and its
  MetaBalance plan (`metabalance_plan.run_plan`), compiled as the loop steps it."""
  lengths = settings.task_feature_lengths
  setup = Setup(
      name=name, config=model.config, input_length=lengths['inputs'],
      target_length=lengths['targets'], batch_size=settings.batch_size,
      pack=settings.pack, mesh_data=settings.mesh_data,
      mesh_model=settings.mesh_model,
      num_microbatches=settings.num_microbatches,
      eval_batch_size=settings.eval_batch_size,
      optimizer=settings.optimizer, z_loss=settings.z_loss, balancing=plan)
  setup.label = _settings_label(setup)
  return setup


# A t5x run configuration, as the gin/t5x files include it: the t5x script
# whose `__main__` functions it binds.
T5X_SCRIPTS = {'t5x/configs/runs/finetune.gin': 'train',
               't5x/configs/runs/pretrain.gin': 'train',
               't5x/configs/runs/eval.gin': 'eval',
               't5x/configs/runs/infer.gin': 'infer'}
_INCLUDE = re.compile(r"^include\s+'([^']+)'", re.MULTILINE)


def t5x_script(gin_files: Sequence[str], search_paths: Sequence[str] = ()
               ) -> Optional[str]:
  """'train' / 'eval' / 'infer' where the first of `gin_files` includes
  t5x's run configuration (directly or through the files it includes: a
  gin/t5x run file), else None (a built-in run). Reads the files' include
  lines only; needs neither gin nor t5x."""
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  search = [p for p in [*search_paths, paths.gin_dir()] if p]
  seen = set()

  def script(name):
    if name in T5X_SCRIPTS:
      return T5X_SCRIPTS[name]
    try:
      path = gin_utils.resolve_gin_file(name, search)
    except ValueError:
      return None  # t5x's own files, or a typo that parsing reports
    if path in seen:
      return None
    seen.add(path)
    with open(path) as f:
      for include in _INCLUDE.findall(f.read()):
        found = script(include)
        if found:
          return found
    return None

  return script(gin_files[0]) if gin_files else None


def run_gin(args) -> int:
  """`--tpu_compile` of the built-in runner's setups: `--gin_file`s (one
  setup; a t5x run file is `hyperprompt_jax.t5x.steps_compile`'s, which the
  command calls), or `--setups` (`setup_gin_files` names), each with the
  `--gin.` bindings."""
  search = [p for p in args.gin_search_paths.split(',') if p]
  if args.setups:
    setups = [gin_setup(name, setup_gin_files(name),
                        args.gin_bindings, search)
              for name in args.setups.split(',') if name]
  else:
    setups = [gin_setup('+'.join(os.path.splitext(os.path.basename(f))[0]
                                 for f in args.gin_file),
                        args.gin_file, args.gin_bindings, search)]
  return print_report(compile_report(args.topology, setups, args.output_json,
                               log=lambda s: print(s, flush=True)),
                args.output_json)
