"""Reading t5x checkpoints (orbax and legacy layouts); writing t5x parameters.

Both layouts are read with the libraries t5x writes them with, so no t5x
install is needed to start from a public t5x checkpoint:

- orbax: `checkpoint_<step>/state/` is an orbax PyTree `{target: params,
  state: {step, param_states}}`. The built-in runner's (`checkpoint_manager`)
  share the folder names with the root `{step, params, opt_state}`; both
  are read here, so one evaluator reads both runners' output.
- legacy (`use_orbax=False`): `checkpoint_<step>/checkpoint` is a msgpack
  file `{version, optimizer: {target, state}}` whose large leaves are
  tensorstore specs pointing at sibling directories.
"""

import os
import re
from typing import Any, Mapping

from etils import epath
import flax
from flax import serialization
from flax import traverse_util
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

PyTree = Any

_CHECKPOINT = re.compile(r'^checkpoint_(\d+)$')


class CheckpointMismatchError(ValueError):
  """A readable checkpoint of another model (shapes or parameters differ)."""


def error_summary(error: Exception) -> str:
  """'Type: first line' of why a checkpoint could not be read."""
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0][:300] if lines else ""}'


def find_checkpoints(path: str) -> list[tuple[int, str]]:
  """`[(step, dir)]` of one `checkpoint_<step>` or a folder of them, by step.

  Incomplete (temporary) orbax saves are not listed.
  """
  path = path.rstrip('/')
  if not epath.Path(path).is_dir():
    raise FileNotFoundError(
        f'CHECKPOINT_PATH {path!r} does not exist: give a checkpoint_<step> '
        'folder or the MODEL_DIR holding them.')
  match = _CHECKPOINT.match(os.path.basename(path))
  if match:
    return [(int(match[1]), path)]
  found = sorted(
      (int(m[1]), os.path.join(path, child.name))
      for child in epath.Path(path).iterdir()
      if (m := _CHECKPOINT.match(child.name)) and child.is_dir())
  if not found:
    raise FileNotFoundError(
        f'CHECKPOINT_PATH {path!r} holds no checkpoint_<step> folders; '
        'train first, or point at a MODEL_DIR that has some.')
  return found


def checkpoint_layout(path: str) -> str:
  """Returns 'orbax' or 'legacy' for a t5x `checkpoint_<step>` directory."""

  path = epath.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(
        f'No checkpoint directory at {path}: give a t5x checkpoint_<step> '
        'directory (e.g. gs://t5-data/pretrained_models/t5x/t5_1_1_base/'
        'checkpoint_1000000).'
    )
  if (path / 'state').is_dir():
    return 'orbax'
  if (path / 'checkpoint').exists():
    return 'legacy'
  steps = sorted(int(m[1]) for child in path.iterdir()
                 if (m := _CHECKPOINT.match(child.name)))
  if steps:
    raise ValueError(
        f'{path} is a run directory (MODEL_DIR) of {len(steps)} checkpoints; '
        'this reads one: give one of its checkpoint_<step> folders, e.g. '
        f'{path / f"checkpoint_{steps[-1]}"} (the newest; steps: '
        f'{", ".join(map(str, steps))}).')
  raise ValueError(
      f'{path} is neither an orbax t5x checkpoint (no state/ directory) nor '
      'a legacy one (no checkpoint file).'
  )


def _restore_orbax_target(path: str) -> PyTree:
  # orbax's tensorstore specs need absolute local paths.
  state_dir = epath.Path(path if '://' in path else os.path.abspath(path))
  state_dir = state_dir / 'state'
  metadata = ocp.PyTreeCheckpointHandler().metadata(state_dir).tree
  # t5x keeps the parameters under 'target', the built-in runner 'params'.
  key = next((k for k in ('target', 'params') if k in metadata), None)
  if key is None:
    raise ValueError(f'{state_dir} holds no parameters (neither t5x\'s '
                     f'"target" nor the built-in runner\'s "params"; it has '
                     f'{sorted(metadata)}).')
  checkpointer = ocp.PyTreeCheckpointer()
  # Read the parameters only (not the optimizer state), as numpy on the host.
  target_meta = {key: metadata[key]}
  restore_args = _map_leaves(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target_meta
  )
  restored = checkpointer.restore(
      state_dir,
      args=ocp.args.PyTreeRestore(
          item=target_meta, restore_args=restore_args, partial_restore=True
      ),
  )
  return restored[key]


def _is_tensorstore_spec(x: Any) -> bool:
  return isinstance(x, Mapping) and 'driver' in x and 'kvstore' in x


def _map_leaves(fn, tree: Any, is_leaf=lambda x: False) -> Any:
  if is_leaf(tree):
    return fn(tree)
  if isinstance(tree, Mapping):
    return {k: _map_leaves(fn, v, is_leaf) for k, v in tree.items()}
  return fn(tree)


def _read_tensorstore(spec: Mapping[str, Any], checkpoint_dir: str):
  spec = dict(spec)
  kvstore = dict(spec['kvstore'])
  relative = kvstore['path']
  if checkpoint_dir.startswith('gs://'):
    bucket, _, prefix = checkpoint_dir[len('gs://'):].partition('/')
    kvstore = {'driver': 'gcs', 'bucket': bucket,
               'path': os.path.join(prefix, relative)}
  else:
    kvstore = {'driver': 'file',
               'path': os.path.join(checkpoint_dir, relative)}
  spec['kvstore'] = kvstore
  return ts.open(spec, open=True, read=True).result().read().result()


def _restore_legacy_target(path: str) -> PyTree:
  raw = serialization.msgpack_restore(
      (epath.Path(path) / 'checkpoint').read_bytes()
  )
  target = raw['optimizer']['target']
  return _map_leaves(
      lambda leaf: (np.asarray(_read_tensorstore(leaf, path))
                    if _is_tensorstore_spec(leaf) else np.asarray(leaf)),
      target,
      is_leaf=_is_tensorstore_spec,
  )


def load_t5x_params(path: str) -> dict[str, np.ndarray]:
  """Reads the parameters of a t5x checkpoint as a flat '/'-keyed dict.

  Args:
    path: a t5x `checkpoint_<step>` directory, orbax or legacy layout, or a
      built-in runner's `checkpoint_<step>`.

  Returns:
    `{'encoder/layers_0/attention/query/kernel': np.ndarray, ...}`.
  """
  path = os.fspath(path)
  if checkpoint_layout(path) == 'orbax':
    target = _restore_orbax_target(path)
  else:
    target = _restore_legacy_target(path)
  return {k: np.asarray(v)
          for k, v in traverse_util.flatten_dict(target, sep='/').items()}


def restore_params(
    path: str,
    abstract_params: PyTree,
    allow_missing: bool = False,
) -> tuple[PyTree, list[str]]:
  """Loads a t5x checkpoint into the structure of `abstract_params`.

  Args:
    path: a t5x `checkpoint_<step>` directory.
    abstract_params: the model's parameter tree (arrays or
      `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape(model.init, ...)`).
    allow_missing: leave parameters the checkpoint lacks (e.g. new
      task-conditioned ones) to the caller instead of raising.

  Returns:
    `(params, missing)`: the nested params with every checkpoint value in
    place (missing ones are `None`), and the '/'-joined missing paths.

  Raises:
    CheckpointMismatchError: naming every parameter whose shape differs,
      and the missing ones unless `allow_missing`.
  """
  return match_params(load_t5x_params(path), abstract_params, path,
                      allow_missing)


def match_params(loaded: Mapping[str, np.ndarray], abstract_params: PyTree,
                 path: str, allow_missing: bool = False
                 ) -> tuple[PyTree, list[str]]:
  """`restore_params` on arrays already read, perhaps changed since.

  `loaded` is `load_t5x_params`' flat dict (new tasks' parameters added, task
  parameters replaced); `path` names their checkpoint in errors.
  """
  wanted = traverse_util.flatten_dict(flax.core.unfreeze(abstract_params),
                                      sep='/')
  mismatched = [
      f'{k}: checkpoint {loaded[k].shape}, model {tuple(v.shape)}'
      for k, v in wanted.items()
      if k in loaded and tuple(loaded[k].shape) != tuple(v.shape)
  ]
  if mismatched:
    raise CheckpointMismatchError(
        f'Checkpoint {path} does not match the model (check the model gin '
        'file is the one the checkpoint was trained with):\n  '
        + '\n  '.join(mismatched)
    )
  missing = sorted(k for k in wanted if k not in loaded)
  if missing and not allow_missing:
    raise CheckpointMismatchError(
        f'Checkpoint {path} lacks {len(missing)} model parameters: '
        + ', '.join(missing[:10]) + (' ...' if len(missing) > 10 else '')
    )
  params = {k: loaded.get(k) for k in wanted}
  return traverse_util.unflatten_dict(params, sep='/'), missing


def param_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """`{'/'-path: shape}` of a checkpoint's parameters, from its metadata."""

  path = os.fspath(path)
  if checkpoint_layout(path) == 'orbax':
    state_dir = epath.Path(path if '://' in path else os.path.abspath(path))
    tree = ocp.PyTreeCheckpointHandler().metadata(state_dir / 'state').tree
    target = tree.get('target', tree.get('params'))
    if target is None:
      raise ValueError(f'{path}/state holds no parameters.')
    flat = traverse_util.flatten_dict(dict(target), sep='/')
    return {k: tuple(v.shape) for k, v in flat.items()}
  raw = serialization.msgpack_restore(
      (epath.Path(path) / 'checkpoint').read_bytes())
  flat = {}

  def shape(leaf):
    if _is_tensorstore_spec(leaf):
      return tuple(leaf['metadata']['shape'])
    return tuple(np.shape(leaf))

  target = _map_leaves(shape, raw['optimizer']['target'],
                       is_leaf=_is_tensorstore_spec)
  for k, v in traverse_util.flatten_dict(target, sep='/').items():
    flat[k] = v
  return flat


def save_t5x_params(params: PyTree, output_dir: str, step: int = 0) -> str:
  """Writes parameters alone as `output_dir/checkpoint_<step>`, t5x's layout.

  `state/` = `{target: params, state: {step}}`, no optimizer state: both
  runners (and t5x) start from it as INITIAL_CHECKPOINT_PATH.

  Args:
    params: the nested parameters (numpy or host-readable jax arrays).
    output_dir: the folder the checkpoint goes into (local or gs://).
    step: the checkpoint's step.

  Returns:
    The `checkpoint_<step>` path.

  Raises:
    ValueError: that checkpoint exists already.
  """
  target = os.path.join(output_dir, f'checkpoint_{step}')
  if epath.Path(target).exists():
    raise ValueError(f'{target} exists: choose a new --output_dir.')
  manager = ocp.CheckpointManager(
      os.path.abspath(output_dir) if '://' not in output_dir else output_dir,
      options=ocp.CheckpointManagerOptions(step_prefix='checkpoint'),
      item_names=('state',))
  # t5x's layout: the parameters under 'target', the step under 'state'.
  manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
      {'target': params, 'state': {'step': np.int32(step)}})))
  manager.wait_until_finished()
  manager.close()
  return target
