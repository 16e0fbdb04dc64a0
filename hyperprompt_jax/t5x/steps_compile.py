r"""t5x's train, eval and predict steps of a t5x run file, compiled for a TPU.

    python -m hyperprompt_jax.compile --topology=v3-32 \
        --gin_file=t5x/hypergrid_lg_glue_super_glue.gin [--gin.X=Y ...] \
        [--eval_batch_size=64] [--output_json=t5x_tpu.json]

(docs/performance.md, "Sizing a t5x job"). The files are parsed as
`python -m t5x.train` parses them, and what `t5x.train.train` builds from
its bindings is built the same way, with no data read and nothing
allocated: the model (`%MODEL`), t5x's `PjitPartitioner` as bound with its
mesh made from the slice's devices (`slice_mesh`), the train state's
shapes and axes (`utils.TrainStateInitializer`), the trainer
(`train_script.train.trainer_cls`, its dropout key made as t5x.train makes
it) and the batches of the model's feature converter (`batch_shapes`).

Each program is partitioned and compiled as t5x does: the trainer's train
step (the state donated), its eval step (on the train_eval batch, if
bound) and predict (`model.predict_batch_with_aux`, partitioned as
`utils.get_infer_fn` does) at `--eval_batch_size` rows (default: the
infer_eval batch size, else `PREDICT_BATCH_SIZE`). The figures are
`program_figures.figures`', in `tpu_compile.compile_report`'s report.
"""

import contextlib
import copy
import dataclasses
import importlib
import inspect
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence
from unittest import mock

import gin
import jax
import numpy as np
from t5x import partitioning as t5x_partitioning
from t5x import utils as t5x_utils

from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.benchmarks import tpu_compile
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.tpu import program_figures
from hyperprompt_jax.tpu import slices

# Rows of predict where the run binds no infer_eval dataset: t5x/eval.gin's
# EVAL_BATCH_SIZE and t5x/infer.gin's INFER_BATCH_SIZE.
PREDICT_BATCH_SIZE = 64


@dataclasses.dataclass
class T5xRun:
  """A t5x run file and what the command adds.

  Attributes:
    name: the run's name in the report.
    gin_files: its gin files, the run file first.
    bindings: `--gin.` bindings.
    search_paths: gin search paths.
    predict_batch_size: predict's rows; None: the run's, else
      `PREDICT_BATCH_SIZE`.
  """
  name: str
  gin_files: Sequence[str]
  bindings: Sequence[str] = ()
  search_paths: Sequence[str] = ()
  predict_batch_size: Optional[int] = None


def t5x_root() -> str:
  """The folder holding the t5x package, which t5x's scripts search."""
  import t5x  # pylint: disable=g-import-not-at-top
  return os.path.dirname(os.path.dirname(t5x.__file__))


@contextlib.contextmanager
def parsed_as_t5x_train(run: T5xRun):
  """gin holding `run`'s files and bindings as `python -m t5x.train` has them.

  t5x's run configuration binds `__main__.train`, so t5x's `train` module
  stands as `__main__` while they are parsed. Yields that module; gin is
  cleared before and after.
  """
  script = importlib.import_module('t5x.train')
  saved = sys.modules['__main__']
  gin.clear_config()
  try:
    sys.modules['__main__'] = script
    try:
      gin_utils.parse_gin(run.gin_files, run.bindings,
                          [*run.search_paths, t5x_root()])
    finally:
      sys.modules['__main__'] = saved
    yield script
  finally:
    gin.clear_config()


def train_arguments(script, names: Sequence[str]) -> dict[str, Any]:
  """`t5x.train.train`'s bound arguments `names`, evaluated as in the call."""
  bound = gin.get_bindings(script.train, resolve_references=False)
  missing = [n for n in names if n not in bound]
  required = [n for n in missing if n in ('model', 'train_dataset_cfg',
                                          'partitioner', 'trainer_cls')]
  if required:
    raise ValueError(f'The gin files bind no train_script.train.{required[0]}'
                     ': give a t5x.train run file (gin/t5x/, which includes '
                     't5x/train.gin).')
  # A reference resolves to what it makes when copied, as gin does for the
  # call (`gin.get_bindings`).
  return {n: copy.deepcopy(bound[n]) if n in bound else None for n in names}


@contextlib.contextmanager
def t5x_rng(random_seed: Optional[int], use_hardware_rng: bool):
  """JAX's PRNG as t5x.train sets it, restored afterwards."""
  saved = jax.config.jax_default_prng_impl
  if use_hardware_rng or random_seed is None:
    t5x_utils.set_hardware_rng_ops()
  try:
    yield
  finally:
    jax.config.update('jax_default_prng_impl', saved)


def slice_mesh(partitioner, devices: Sequence[jax.Device]
               ) -> jax.sharding.Mesh:
  """The partitioner's mesh as t5x makes it on the slice's hosts.

  Its own `mesh` (t5x's `default_mesh`), computed while `jax.devices()` lists
  the slice's devices and `jax.local_devices()` host 0's; kept on the
  partitioner.

  Raises:
    ValueError: t5x has no default mesh for the slice and `num_partitions`,
      or the submesh does not tile the slice; the message names the binding
      that fixes it.
  """
  def all_devices(backend=None):
    del backend
    return list(devices)

  def local_devices(process_index=None, backend=None, host_id=None):
    del backend
    index = process_index if process_index is not None else host_id or 0
    return [d for d in devices if d.process_index == index]

  # pylint: disable=protected-access
  setting = (f'model_parallel_submesh={partitioner._model_parallel_submesh}'
             if partitioner._model_parallel_submesh
             else f'num_partitions={partitioner._num_partitions}')
  # pylint: enable=protected-access
  cores = slices.devices_per_chip(devices)
  fix = (
      'Bind the model-parallel tile of (x, y, z, cores) chips along the '
      'slice\'s axes and cores of a chip, whose product is the model axis, '
      "e.g. --gin.MESH_MODEL=None --gin.partitioning.PjitPartitioner."
      f"model_parallel_submesh='(1, 1, 1, {cores})'"
      + (" or '(1, 2, 1, 1)'" if cores == 1 else '')
      + ' (the same bindings work in the t5x.train run; MESH_MODEL binds '
      'num_partitions in t5x/model.gin).')
  with mock.patch.object(jax, 'devices', all_devices), \
       mock.patch.object(jax, 'local_devices', local_devices):
    try:
      return partitioner.mesh
    except ValueError as e:  # t5x: 'No default mesh for this configuration'
      raise ValueError(
          f"t5x's PjitPartitioner has no mesh for {devices[0].device_kind} "
          f'({len(devices)} devices, {cores} a chip) with {setting}: '
          f'{str(e).splitlines()[0].strip()} {fix}') from e
    except AssertionError as e:  # t5x's get_mesh: the tile does not divide
      raise ValueError(
          f"t5x's PjitPartitioner cannot tile {devices[0].device_kind} "
          f'({len(devices)} devices) with {setting}: {e}. {fix}') from e


def batch_shapes(model, lengths: dict[str, int], rows: int, pack: bool,
                 use_custom_packing_ops: bool = False
                 ) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch t5x feeds the model, as shapes.

  The features of the model's feature converter (as t5x's
  `utils.get_dataset` builds it) at its model lengths for task lengths
  `lengths`: `[rows, length]`, or `[rows]` for a scalar feature, int32.
  """
  converter = model.FEATURE_CONVERTER_CLS(
      pack=pack, use_custom_packing_ops=use_custom_packing_ops)
  # The pass-through features (unpacked `task_ids`, rank 0) have their spec
  # only in seqio's private field.
  specs = {**converter.MODEL_FEATURES,
           **(getattr(converter, '_passthrough_features', None) or {})}
  out = {}
  for name, length in converter.get_model_feature_lengths(lengths).items():
    spec = specs.get(name)  # packing's segment ids and positions: int32
    rank = spec.rank if spec is not None else 1
    dtype = spec.dtype.as_numpy_dtype if spec is not None else np.int32
    out[name] = jax.ShapeDtypeStruct((rows, length)[:1 + (rank > 0)], dtype)
  return out


def eos_id(model) -> tuple[int, Optional[str]]:
  """The run's end-of-sequence id, and why it is a stand-in if it is.

  Where this host cannot read the vocabulary, predict compiles with 1, t5x's
  fallback and T5's id: a constant that changes no shape or cost.
  """
  try:
    return model.output_vocabulary.eos_id or 1, None
  except Exception as e:  # pylint: disable=broad-except
    return 1, f'{type(e).__name__}: {e}'[:300]


def _infer_step_with_indices(infer_step: Callable[..., Any], eos: int):
  """`utils.get_infer_fn`'s step around `infer_step`, with `eos`."""
  signature = inspect.signature(infer_step).parameters

  def step(params, batch, rng, indices, flax_mutables):
    kwargs = ({'flax_mutables': flax_mutables}
              if 'flax_mutables' in signature else {})
    kwargs['decoder_params'] = {'eos_id': eos}
    if 'rng' in signature:
      return indices, infer_step(params, batch, rng, **kwargs)
    return indices, infer_step(params, batch, **kwargs)
  return step


def _rows(partitioner, rows: int, setting: str) -> None:
  """t5x's check that `rows` split over the data shards, naming the setting."""
  try:
    partitioner.get_data_layout(rows)
  except ValueError as e:
    raise ValueError(
        f'{setting}={rows} does not split over the mesh ({e}): set it to a '
        f'multiple of {partitioner.data_mesh_size}, or change the mesh '
        '(MESH_MODEL / model_parallel_submesh).') from e


def _label(model, partitioner, num_microbatches: Optional[int],
           pack: bool) -> str:
  """The settings that change a step's memory, where not the default."""
  # pylint: disable=protected-access
  submesh = partitioner._model_parallel_submesh
  parts = [f'model_parallel_submesh={tuple(submesh)}' if submesh
           else f'num_partitions={partitioner._num_partitions}']
  # pylint: enable=protected-access
  if (num_microbatches or 1) > 1:
    parts.append(f'NUM_MICROBATCHES={num_microbatches}')
  remat = model.module.config.remat_policy
  if remat != 'none':
    parts.append(f'REMAT_POLICY={remat}')
  balancing = getattr(model, 'balancing', None)
  if balancing is not None:
    parts.append(f'MetaBalance {balancing.settings.auxiliaries}')
  if not pack:
    parts.append('unpacked')
  return ', '.join(parts)


def compile_run(run: T5xRun, devices: Sequence[jax.Device],
                log: Callable[[str], None] = lambda _: None,
                hlo_dir: Optional[str] = None) -> dict[str, Any]:
  """Compiles `run`'s train, eval and predict steps for `devices`.

  A program that does not compile gets its error instead of figures.

  Args:
    run: the t5x run.
    devices: the slice's devices.
    log: takes each program's line.
    hlo_dir: where to write the programs' HLO (None: nowhere).

  Returns:
    The report, read like `tpu_compile.compile_setup`'s.

  Raises:
    ValueError: the mesh or a batch does not fit the slice (the message
      names the setting), or the files are not a t5x.train run.
  """
  with parsed_as_t5x_train(run) as script:
    bound = train_arguments(script, (
        'model', 'train_dataset_cfg', 'train_eval_dataset_cfg',
        'infer_eval_dataset_cfg', 'partitioner', 'trainer_cls',
        'random_seed', 'use_hardware_rng', 'train_state_initializer_cls'))
    with t5x_rng(bound['random_seed'], bool(bound['use_hardware_rng'])):
      return _compile_bound(run, bound, devices, log, hlo_dir)


def _compile_bound(run: T5xRun, bound: dict[str, Any],
                   devices: Sequence[jax.Device], log, hlo_dir
                   ) -> dict[str, Any]:
  """`compile_run` once the run's objects are built, gin still parsed."""
  model, partitioner = bound['model'], bound['partitioner']
  train_cfg = bound['train_dataset_cfg']
  mesh = slice_mesh(partitioner, devices)
  _rows(partitioner, train_cfg.batch_size, 'BATCH_SIZE')
  lengths = dict(train_cfg.task_feature_lengths)
  train_batch = batch_shapes(model, lengths, train_cfg.batch_size,
                             train_cfg.pack,
                             train_cfg.use_custom_packing_ops)
  initializer_cls = (bound['train_state_initializer_cls']
                     or t5x_utils.TrainStateInitializer)
  initializer = initializer_cls(
      optimizer_def=model.optimizer_def, init_fn=model.get_initial_variables,
      input_shapes={k: v.shape for k, v in train_batch.items()},
      input_types={k: v.dtype for k, v in train_batch.items()},
      partitioner=partitioner)
  state = initializer.global_train_state_shape
  axes = initializer.train_state_axes
  trainer = bound['trainer_cls'](
      model=model, train_state=state, partitioner=partitioner,
      eval_names=(), summary_dir=None, train_state_axes=axes,
      rng=jax.random.PRNGKey(bound['random_seed'] or 0))
  eval_cfg = bound['train_eval_dataset_cfg']
  infer_cfg = bound['infer_eval_dataset_cfg']
  predict_rows = run.predict_batch_size or (
      infer_cfg.batch_size if infer_cfg else PREDICT_BATCH_SIZE)
  num_microbatches = getattr(trainer, '_num_microbatches', None)
  report = {
      'setup': run.name, 'runner': 't5x',
      'label': _label(model, partitioner, num_microbatches, train_cfg.pack),
      'mesh': dict(mesh.shape),
      # pylint: disable=protected-access
      'num_partitions': partitioner._num_partitions,
      'model_parallel_submesh': partitioner._model_parallel_submesh,
      # pylint: enable=protected-access
      'trainer': type(trainer).__name__, 'batch_size': train_cfg.batch_size,
      'lengths': lengths, 'pack': train_cfg.pack,
      'num_microbatches': num_microbatches or 1,
      'remat_policy': model.module.config.remat_policy,
      'metabalance': None if getattr(model, 'balancing', None) is None else {
          'auxiliaries': model.balancing.settings.auxiliaries,
          'num_auxiliary': model.balancing.num_auxiliary},
      'eval_batch_size': eval_cfg.batch_size if eval_cfg else None,
      'predict_batch_size': predict_rows,
      'programs': {}}

  # pylint: disable=protected-access
  # t5x's Trainer.compile_train / compile_eval compile these properties
  # with `partitioner.compile` (lower + compile) and keep the result
  # private, logging a summary at the state's step, which a state of shapes
  # lacks: the same call is made here for the compiled object.
  def train():
    return [trainer._partitioned_train_step, state, train_batch]

  def evaluate():
    _rows(partitioner, eval_cfg.batch_size,
          'train_eval/utils.DatasetConfig.batch_size')
    return [trainer._partitioned_eval_step, state, batch_shapes(
        model, dict(eval_cfg.task_feature_lengths or lengths),
        eval_cfg.batch_size, eval_cfg.pack, eval_cfg.use_custom_packing_ops)]
  # pylint: enable=protected-access

  def predict():
    _rows(partitioner, predict_rows, '--eval_batch_size (predict rows)')
    eos, unread = eos_id(model)
    if unread:
      report['predict_eos_id'] = (
          f'{eos}, a stand-in: the vocabulary was not read ({unread})')
      log(f'predict: end-of-sequence id {eos} in place of the vocabulary\'s, '
          f'which this host cannot read ({unread}); the figures do not '
          'depend on it')
    step = partitioner.partition(
        _infer_step_with_indices(model.predict_batch_with_aux, eos),
        in_axis_resources=(axes.params, partitioner.data_partition_spec,
                           None, partitioner.data_partition_spec,
                           axes.flax_mutables),
        out_axis_resources=(None, None))
    indices = jax.ShapeDtypeStruct((predict_rows,), np.int32)
    return [step, state.params,
            batch_shapes(model, lengths, predict_rows, pack=False),
            None, indices, state.flax_mutables]

  programs = [('train', train)]
  if eval_cfg is not None:
    programs.append(('eval', evaluate))
  programs.append(('predict', predict))
  hbm = slices.device_hbm_bytes(devices)
  cores = slices.devices_per_chip(devices)
  try:
    for kind, build in programs:
      try:
        step, *args = build()
        start = time.perf_counter()
        compiled = partitioner.compile(step, *args)
        program = program_figures.figures(
            compiled, time.perf_counter() - start, hbm, tuple(args), None,
            tpu_compile.hlo_file(hlo_dir, f'{run.name} {report["label"]}',
                                 kind))
        if kind == 'train':
          params = state.params
          program['six_nd_flops'] = mfu.six_nd_flops(params, train_batch)
          program['flops_over_6nd'] = (
              program['flops'] * mesh.size / program['six_nd_flops']
              if program['flops'] else None)
          program['parameters'] = sum(math.prod(a.shape)
                                      for a in jax.tree.leaves(params))
        if cores > 1:
          program['per_chip'] = program_figures.per_chip(program, cores)
      except Exception as e:  # pylint: disable=broad-except
        program = {'error': f'{type(e).__name__}: {e}'[:2000]}
      report['programs'][kind] = program
      log(tpu_compile.format_program(run.name, kind, program))
  finally:
    trainer.close()  # its metric writers' threads
  return report


def run(args, search_paths: Sequence[str]) -> int:
  """`--tpu_compile` of a t5x run file, with the command's flags."""
  name = '+'.join(os.path.splitext(os.path.basename(f))[0]
                  for f in args.gin_file)
  setup = T5xRun(name=name, gin_files=list(args.gin_file),
                 bindings=list(args.gin_bindings), search_paths=search_paths,
                 predict_batch_size=args.eval_batch_size)
  report = tpu_compile.compile_report(
      args.topology, [setup], args.output_json,
      log=lambda s: print(s, flush=True), compile_fn=compile_run)
  return tpu_compile.print_report(report, args.output_json)
