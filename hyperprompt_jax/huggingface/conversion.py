"""Hugging Face T5 directories <-> t5x-layout checkpoints.

The command is `python -m hyperprompt_jax.convert` (docs/huggingface.md).

From transformers: `config.json` + `model.safetensors` (or its sharded
index) -> `<output_dir>/checkpoint_<step>/` in t5x's orbax layout
(parameters only, float32) and `<output_dir>/model.gin`. Any method starts
from it as INITIAL_CHECKPOINT_PATH: the backbone loads, the method's
parameters are initialised as in a fresh run.

To transformers: a checkpoint's T5 backbone -> a directory that
`T5ForConditionalGeneration.from_pretrained` loads; an MTL model is complete
there. Prompt-Tuning's soft prompts go beside it as one PEFT prompt-tuning
adapter per task (`prompt_tuning/<task>/`, indexed by
`prompt_tuning/prompts.json`). The other methods' parameters have no
transformers form: they go to `task_params.npz` (`export_task_params`).

safetensors files are read and written with `safetensors.numpy`: neither
PyTorch nor transformers is needed.
"""

import argparse
import dataclasses
import json
import logging
import os
import shutil
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from safetensors import numpy as safetensors_numpy

from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.huggingface import model_config
from hyperprompt_jax.huggingface import weight_names
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network

log = logging.getLogger('hyperprompt_jax.convert')

CONFIG = 'config.json'
WEIGHTS = 'model.safetensors'
WEIGHTS_INDEX = 'model.safetensors.index.json'
SENTENCEPIECE = 'spiece.model'  # transformers' T5 tokenizer file
TOKENIZER_CONFIG = 'tokenizer_config.json'
GIN = 'model.gin'
# T5's sentinel ids after the SentencePiece pieces (seqio's
# SentencePieceVocabulary(extra_ids=100), tasks/features.py's T5_EXTRA_IDS).
T5_EXTRA_IDS = 100
PROMPTS_DIR = 'prompt_tuning'
TASK_PARAMS = 'task_params.npz'
# Each method's name in messages (hypergrid's Output Gating variant apart).
_METHOD_NAMES = {'hyperprompt': 'HyperPrompt', 'hypergrid': 'HyperGrid',
                 'adapter': 'the Vanilla Adapter', 'hyperformer':
                 'HyperFormer++', 'prompt_tuning': 'Prompt-Tuning'}


@dataclasses.dataclass(frozen=True)
class FromHF:
  """What `from_hf` wrote.

  Attributes:
    checkpoint: the `checkpoint_<step>` directory.
    config: the model's `T5Config`.
    gin_file: the path of `model.gin`.
    gin_text: its text.
  """

  checkpoint: str
  config: network.T5Config
  gin_file: str
  gin_text: str


def read_hf_dir(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Reads a transformers directory.

  Args:
    path: holds `config.json` and `model.safetensors` or its sharded index.

  Returns:
    `(config.json's dict, {tensor name: array})`.

  Raises:
    FileNotFoundError: no config.json, or no safetensors weights.
    ValueError: an index naming a tensor its shard lacks.
  """
  config_path = os.path.join(path, CONFIG)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
        f'{path} has no {CONFIG}: give a transformers T5 directory (what '
        'save_pretrained writes, or a Hugging Face Hub snapshot).')
  with open(config_path, encoding='utf-8') as f:
    config = json.load(f)
  single, index = (os.path.join(path, WEIGHTS),
                   os.path.join(path, WEIGHTS_INDEX))
  if os.path.isfile(single):
    return config, dict(safetensors_numpy.load_file(single))
  if not os.path.isfile(index):
    raise FileNotFoundError(
        f'{path} has neither {WEIGHTS} nor {WEIGHTS_INDEX} (PyTorch .bin '
        'weights are not read: re-save them with transformers, '
        'save_pretrained(dir, safe_serialization=True)).')
  with open(index, encoding='utf-8') as f:
    weight_map = json.load(f)['weight_map']
  tensors = {}
  for shard in sorted(set(weight_map.values())):
    tensors.update(safetensors_numpy.load_file(os.path.join(path, shard)))
  absent = sorted(k for k in weight_map if k not in tensors)
  if absent:
    raise ValueError(f'{index} lists tensors its shards lack: '
                     f'{", ".join(absent[:5])}.')
  return config, tensors


def write_hf_dir(path: str, config: Mapping[str, Any],
                 tensors: Mapping[str, np.ndarray]) -> None:
  """Writes `config.json` and one `model.safetensors` (pt metadata)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG), 'w', encoding='utf-8') as f:
    json.dump(dict(config), f, indent=2, sort_keys=True)
    f.write('\n')
  safetensors_numpy.save_file(dict(tensors), os.path.join(path, WEIGHTS),
                              metadata={'format': 'pt'})


def extra_ids_of(hf_dir: str) -> int:
  """The tokenizer's sentinel ids: tokenizer_config.json's, else T5's 100."""
  path = os.path.join(hf_dir, TOKENIZER_CONFIG)
  if os.path.isfile(path):
    with open(path, encoding='utf-8') as f:
      extra = json.load(f).get('extra_ids')
    if extra is not None:
      return int(extra)
  return T5_EXTRA_IDS


def check_vocabulary(vocab_size: int, sentencepiece_model: str,
                     extra_ids: int = T5_EXTRA_IDS) -> int:
  """Refuses a vocabulary smaller than the tokenizer's; returns the latter.

  The tokenizer's ids are the SentencePiece pieces, then the sentinels, as
  seqio's SentencePieceVocabulary numbers them.
  """
  import sentencepiece  # pylint: disable=g-import-not-at-top
  pieces = sentencepiece.SentencePieceProcessor(
      model_file=sentencepiece_model).get_piece_size()
  needed = pieces + extra_ids
  if vocab_size < needed:
    raise ValueError(
        f'config.json: vocab_size {vocab_size} is smaller than the '
        f'tokenizer\'s {needed} ids ({sentencepiece_model}: {pieces} pieces + '
        f'{extra_ids} sentinels): its largest ids would fall outside the '
        'embedding. Give the SentencePiece model these weights were trained '
        'with (--sentencepiece_model).')
  return needed


def write_tokenizer(output_dir: str, sentencepiece_model: str,
                    extra_ids: int = T5_EXTRA_IDS) -> None:
  """Writes transformers' T5 tokenizer files, numbering as seqio's would."""
  shutil.copyfile(sentencepiece_model,
                  os.path.join(output_dir, SENTENCEPIECE))
  with open(os.path.join(output_dir, TOKENIZER_CONFIG), 'w',
            encoding='utf-8') as f:
    json.dump({'tokenizer_class': 'T5Tokenizer', 'extra_ids': extra_ids},
              f, indent=2)


def from_hf(hf_dir: str, output_dir: str, step: int = 0,
            sentencepiece_model: Optional[str] = None,
            num_tasks: int = 8) -> FromHF:
  """Converts a transformers T5 directory to a t5x-layout checkpoint.

  Args:
    hf_dir: config.json + model.safetensors (or its sharded index).
    output_dir: gets `checkpoint_<step>/` and `model.gin`.
    step: the checkpoint's step (a run fine-tuning from it starts at 0).
    sentencepiece_model: checked against vocab_size (default: the
      directory's spiece.model, when there is one).
    num_tasks: the task-id space of the returned config.

  Returns:
    The checkpoint's path, the config, the gin file and its text.

  Raises:
    ValueError: a config the network cannot represent, tensors that do
      not fit it, a vocabulary smaller than the tokenizer's.
    FileNotFoundError: a directory without config.json or weights.
  """
  config, tensors = read_hf_dir(hf_dir)
  cfg = model_config.from_hf(config, num_tasks)
  if sentencepiece_model is None and os.path.isfile(
      os.path.join(hf_dir, SENTENCEPIECE)):
    sentencepiece_model = os.path.join(hf_dir, SENTENCEPIECE)
  if sentencepiece_model:
    check_vocabulary(cfg.vocab_size, sentencepiece_model,
                     extra_ids_of(hf_dir))
  flat = weight_names.to_t5x(tensors, weight_names.Backbone.of(cfg),
                             source=f'{hf_dir} weights')
  nested = {}
  for path, value in flat.items():
    *scopes, leaf = path.split('/')
    node = nested
    for scope in scopes:
      node = node.setdefault(scope, {})
    node[leaf] = value
  checkpoint = checkpoints.save_t5x_params(nested, output_dir, step)
  text = model_config.gin_text(cfg, os.path.abspath(hf_dir))
  gin_file = os.path.join(output_dir, GIN)
  with open(gin_file, 'w', encoding='utf-8') as f:
    f.write(text)
  return FromHF(checkpoint, cfg, gin_file, text)


def method_names(cfg: network.T5Config) -> list[str]:
  """The task-conditioning methods `cfg` turns on, by name."""
  names = []
  for field in _METHOD_NAMES:
    method_cfg = getattr(cfg, field)
    if method_cfg is None:
      continue
    if field == 'hypergrid' and method_cfg.variant == 'output_gating':
      names.append('Output Gating')
    else:
      names.append(_METHOD_NAMES[field])
  return names


def _prompts_path(params: Mapping[str, np.ndarray]) -> str:
  """The path of Prompt-Tuning's prompt table in `params`."""
  found = [k for k in params if k.endswith('prompt_tuning/prompts')]
  if len(found) != 1:
    raise ValueError(f'Expected one Prompt-Tuning prompt table, found '
                     f'{found}.')
  return found[0]


def write_prompts(output_dir: str, prompts: np.ndarray,
                  task_list: Sequence[str], cfg: network.T5Config,
                  base_model: str) -> str:
  """Writes Prompt-Tuning's prompts as one PEFT adapter per task.

  With one transformer submodule PEFT prepends the prompt to the encoder's
  input embeddings, as the project's Prompt-Tuning does.

  Args:
    output_dir: gets `prompt_tuning/<task>/` and `prompt_tuning/prompts.json`.
    prompts: `[tasks, n, d_model]`.
    task_list: the tasks in id order.
    cfg: the model's config.
    base_model: the transformers model the adapters name.

  Returns:
    The `prompt_tuning` folder.
  """
  root = os.path.join(output_dir, PROMPTS_DIR)
  num_tasks, length, dim = prompts.shape
  if len(task_list) > num_tasks:
    raise ValueError(f'{len(task_list)} tasks but {num_tasks} prompt rows.')
  index = {}
  for task_id, task in enumerate(task_list):
    folder = os.path.join(root, task)
    os.makedirs(folder, exist_ok=True)
    safetensors_numpy.save_file(
        {'prompt_embeddings': np.ascontiguousarray(
            prompts[task_id], np.float32)},
        os.path.join(folder, 'adapter_model.safetensors'),
        metadata={'format': 'pt'})
    with open(os.path.join(folder, 'adapter_config.json'), 'w',
              encoding='utf-8') as f:
      json.dump({'peft_type': 'PROMPT_TUNING', 'task_type': 'SEQ_2_SEQ_LM',
                 'num_virtual_tokens': length, 'token_dim': dim,
                 'num_transformer_submodules': 1,
                 'num_attention_heads': cfg.num_heads,
                 'num_layers': cfg.num_encoder_layers,
                 'prompt_tuning_init': 'RANDOM', 'inference_mode': True,
                 'base_model_name_or_path': base_model}, f, indent=2)
    index[task] = {'task_id': task_id, 'adapter': task}
  with open(os.path.join(root, 'prompts.json'), 'w', encoding='utf-8') as f:
    json.dump({
        'meaning': 'Prompt-Tuning soft prompts, one per task: prepended to '
                   "the encoder's input embeddings (n always-attended "
                   'positions before the tokens), each a PEFT prompt-tuning '
                   'adapter of the T5 in the folder above.',
        'shape': [length, dim], 'dims': ['prompt_length', 'd_model'],
        'tensor': 'prompt_embeddings', 'dtype': 'float32',
        'tasks': index}, f, indent=2)
  return root


def to_hf(cfg: network.T5Config, params: Mapping[str, np.ndarray],
          output_dir: str, task_list: Sequence[str] = (),
          source: str = 'the checkpoint') -> dict[str, Any]:
  """Writes a model's T5 backbone as a transformers directory.

  Prompt-Tuning's prompts go beside it as PEFT adapters.

  Args:
    cfg: the model's config.
    params: its flat '/'-keyed parameters (backbone and task-conditioned).
    output_dir: gets config.json, model.safetensors (and prompt_tuning/).
    task_list: the run's tasks in id order (names Prompt-Tuning's files).
    source: names the parameters' origin in errors.

  Returns:
    `{'methods': [...], 'complete': whether transformers runs the whole
    model (with PEFT for Prompt-Tuning), 'prompts': folder or None}`.
  """
  backbone = {k: v for k, v in params.items()
              if not param_groups.is_task_conditioned(k)}
  tensors = weight_names.to_hf(backbone, weight_names.Backbone.of(cfg),
                               source)
  write_hf_dir(output_dir, model_config.to_hf(cfg), tensors)
  names = method_names(cfg)
  prompts = None
  if cfg.prompt_tuning is not None:
    prompts = write_prompts(output_dir, np.asarray(
        params[_prompts_path(params)]), task_list, cfg,
                            os.path.abspath(output_dir))
  return {'methods': names, 'prompts': prompts,
          'complete': not names or names == ['Prompt-Tuning']}


def checkpoint_to_hf(model: network.Transformer, checkpoint_path: str,
                     output_dir: str, task_list: Sequence[str]
                     ) -> dict[str, Any]:
  """`to_hf` of a checkpoint of either runner.

  A task-conditioned method's parameters also go to
  `output_dir/task_params.npz` (`export_task_params`).

  Args:
    model: the network the checkpoint holds.
    checkpoint_path: a `checkpoint_<step>` directory, either layout.
    output_dir: a new directory.
    task_list: the run's tasks in id order.

  Returns:
    `to_hf`'s result, with 'task_params': the artifact's path or None.

  Raises:
    ValueError: an output that exists, a checkpoint of another model.
  """
  from hyperprompt_jax.checkpointing import task_params_export  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.checkpointing import run_record  # pylint: disable=g-import-not-at-top
  if os.path.exists(os.path.join(output_dir, CONFIG)):
    raise ValueError(f'{output_dir} holds a {CONFIG} already: choose a new '
                     '--output_dir.')
  run_record.check_checkpoint(checkpoint_path, model.config, task_list)
  loaded = checkpoints.load_t5x_params(checkpoint_path)
  checkpoints.match_params(
      loaded, network.abstract_variables(model)['params'], checkpoint_path)
  out = to_hf(model.config, loaded, output_dir, task_list, checkpoint_path)
  out['task_params'] = None
  if not out['complete']:
    out['task_params'] = os.path.join(output_dir, TASK_PARAMS)
    task_params_export.export(model, checkpoint_path, out['task_params'],
                              task_list)
  return out


def _statement(out: Mapping[str, Any], output_dir: str) -> str:
  """What transformers can run of the written model, in words."""
  if not out['methods']:
    return (f'{output_dir}: the whole model (MTL T5); '
            'T5ForConditionalGeneration.from_pretrained loads it.')
  if out['complete']:
    return (f'{output_dir}: the T5 backbone; Prompt-Tuning\'s per-task '
            f"prompts are PEFT adapters in {out['prompts']} "
            '(PeftModel.from_pretrained(model, that folder/<task>)).')
  methods = ' + '.join(out['methods'])
  return (f'{output_dir}: the T5 backbone only. transformers alone cannot '
          f'run {methods}: without its task parameters this is a plain T5, '
          f"not the trained model. They are in {out['task_params']} (the "
          'project\'s export_task_params artifact); the whole model runs '
          'with this project (INITIAL_CHECKPOINT_PATH + TASK_PARAMS_PATH).')


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.convert` with its parsed flags."""
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.log_to_stdout(log)
  if bool(args.from_hf) == bool(args.to_hf):
    raise ValueError('Give --from_hf=<transformers dir> or --to_hf (with '
                     '--checkpoint_path and the gin model).')
  if not args.output_dir:
    raise ValueError('Give --output_dir.')
  if args.from_hf:
    out = from_hf(args.from_hf, args.output_dir, args.step,
                  args.sentencepiece_model)
    log.info('Wrote %s (t5x layout) and %s.', out.checkpoint, out.gin_file)
    print(out.gin_text, end='')
    log.info('Start a run from it: --gin_file=%s (before the variant and '
             "run files) --gin.INITIAL_CHECKPOINT_PATH=\"'%s'\".",
             out.gin_file, os.path.abspath(out.checkpoint))
    return 0
  if not args.checkpoint_path:
    raise ValueError('--to_hf needs --checkpoint_path.')
  import gin  # pylint: disable=g-import-not-at-top
  gin_utils.import_tensorflow_quietly()  # the tasks' registry (seqio)
  gin_utils.parse_gin_flags(args)
  from hyperprompt_jax.tasks import task_ids  # pylint: disable=g-import-not-at-top
  model = gin.get_configurable(network.Transformer)()
  task_list = list(task_ids.run_task_list())
  task_ids.check_num_tasks(model.config.num_tasks, task_list)
  out = checkpoint_to_hf(model, args.checkpoint_path, args.output_dir,
                         task_list)
  if args.sentencepiece_model:
    write_tokenizer(args.output_dir, args.sentencepiece_model)
  log.info('%s', _statement(out, args.output_dir))
  return 0
