"""The t5x adapter: an `EncoderDecoderModel` that carries `task_ids`.

t5x's `models.EncoderDecoderModel` calls the network without task ids; this
subclass passes each batch's (int32 `[batch]`, added by its
`FEATURE_CONVERTER_CLS`; per-token `encoder_task_ids` / `decoder_task_ids`
on packed rows) to every network call: initialisation (task id 0), the
loss, eval and scoring (`_compute_logits`), and prediction, whose cache is
created with the real task ids (`_compute_kv_cache`: HyperPrompt's decoder
prompts are made once and kept in it, beam-expanded like every batch-major
cache leaf) and whose steps get the beam-expanded ids.

MetaBalance (gin/t5x/metabalance.gin): the model holds the run's plan and
its moving averages as the flax collection 'metabalance', kept in the train
state's `flax_mutables` (so checkpoints hold it);
`metabalance_trainer.MetaBalanceTrainer` takes the gradient of
`loss_shares`. The optimizer is `OptaxWrapper` around `make_optimizer`
(gin/t5x/model.gin); importing this module teaches t5x's partitioner its
state (`optax_state_axes`).

t5x is imported in this folder only (and by `steps_compile.py`), and no
module outside it imports them, so the package works without t5x.
"""

import functools
from typing import Any, Mapping, MutableMapping, Optional

import flax
from flax import traverse_util
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import seqio
from t5x import decoding
from t5x import losses as t5x_losses
from t5x import models
from t5x import optimizers

from hyperprompt_jax.common import batches
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import inputs
from hyperprompt_jax.t5x import optax_state_axes  # registers the rules: pylint: disable=unused-import
from hyperprompt_jax.tasks import feature_converter
from hyperprompt_jax.tasks import task_ids as task_ids_lib
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import metabalance_plan

PyTree = Any
TASK_IDS = feature_converter.TASK_IDS
# The flax collection of MetaBalance's moving averages (the built-in
# runner's state key too).
METABALANCE = 'metabalance'


class TaskIdsEncoderDecoderModel(models.EncoderDecoderModel):
  """t5x's encoder-decoder model with per-example task ids.

  Takes `EncoderDecoderModel`'s arguments; `module` is a
  `network.Transformer`. Batches carry `task_ids` (int32 `[batch]`) beside
  t5x's features, or, packed, per-token `encoder_task_ids` /
  `decoder_task_ids`; a task-conditioned network refuses a batch without
  them. The default feature converter reserves Prompt-Tuning's prompt
  positions in packed rows and checks task ids on the host, so the network's
  in-graph check (`T5Config.check_traced_task_ids`, a host callback that would
  only repeat it) is left out of t5x's steps; a `feature_converter_cls` that
  does not check (`converter_checks_batches`) keeps it.

  With `gradient_balancing='metabalance'`, the model holds the run's plan
  (`balancing`) and its initial variables the moving averages;
  `MetaBalanceTrainer` steps it.

  Raises:
    ValueError: at construction, when NUM_TASKS is smaller than the run's
      task list, or MetaBalance's settings do not fit the run.
  """

  FEATURE_CONVERTER_CLS = feature_converter.TaskIdsEncDecFeatureConverter

  def __init__(
      self,
      module: network.Transformer,
      input_vocabulary: seqio.Vocabulary,
      output_vocabulary: seqio.Vocabulary,
      optimizer_def: optimizers.OptimizerDefType,
      decode_fn: models.DecodeFnCallable = decoding.beam_search,
      feature_converter_cls: Optional[Any] = None,
      label_smoothing: float = 0.0,
      z_loss: float = 0.0,
      loss_normalizing_factor: Optional[Any] = None,
      default_decoder_params: Optional[models.DecoderParams] = None,
      gradient_balancing: Optional[str] = None,
      metabalance_settings: Optional[metabalance.Settings] = None,
      mixture_or_task_name: Optional[str] = None,
  ):
    # t5x builds the model after parsing gin, so the run's task list is
    # known: an id space smaller than it would clamp ids silently in jit.
    task_ids_lib.check_num_tasks(module.config.num_tasks)
    if gradient_balancing is not None and not mixture_or_task_name:
      raise ValueError(
          f'GRADIENT_BALANCING={gradient_balancing!r} needs the mixture the '
          'run trains: bind TaskIdsEncoderDecoderModel.mixture_or_task_name '
          '= %MIXTURE_OR_TASK_NAME (gin/t5x/metabalance.gin does).')
    self.balancing = metabalance_plan.run_plan(
        gradient_balancing, metabalance_settings, module,
        mixture_or_task_name)
    packed_rows = batches.RowFormat.of(module.config, pack=True)
    if feature_converter_cls is None:
      # t5x tells the converter whether to pack; the slots it reserves and
      # the examples a row may hold when it does are the model's (unpacked,
      # the converter ignores them), and it checks every task id against
      # the model's id space on the host.
      feature_converter_cls = functools.partial(
          feature_converter.TaskIdsEncDecFeatureConverter,
          input_prompt_length=packed_rows.input_prompt_length,
          max_examples_per_row=packed_rows.max_examples,
          num_tasks=module.config.num_tasks)
    if converter_checks_batches(feature_converter_cls, module.config):
      # Every batch of t5x's train, eval and infer runs comes through this
      # converter: the steps need no in-graph check (a host callback, off
      # JAX's fast dispatch and its compilation cache).
      module = network.checked_on_host(module)
    super().__init__(
        module, input_vocabulary, output_vocabulary, optimizer_def,
        decode_fn=decode_fn, feature_converter_cls=feature_converter_cls,
        label_smoothing=label_smoothing, z_loss=z_loss,
        loss_normalizing_factor=loss_normalizing_factor,
        default_decoder_params=default_decoder_params)

  def _task_ids(self, batch: Mapping[str, jax.Array]) -> Optional[jax.Array]:
    """The batch's task ids; ValueError if a conditioned network lacks them."""
    ids = batch.get(TASK_IDS)
    if ids is None and network.is_task_conditioned(self.module.config):
      raise ValueError(
          f"The batch has no '{TASK_IDS}' (features: {sorted(batch)}), and "
          'the network is task-conditioned. Feed it tasks registered with '
          'hyperprompt_jax.tasks through the feature converter '
          'TaskIdsEncDecFeatureConverter (do not set feature_converter_cls '
          'to another converter).')
    return ids

  def _task_id_inputs(self, batch: Mapping[str, jax.Array]
                      ) -> dict[str, Optional[jax.Array]]:
    """The network's task-id arguments, per token on packed rows."""
    if inputs.is_packed(batch):
      return {k: batch[k] for k in ('encoder_task_ids', 'decoder_task_ids')}
    return {'task_ids': self._task_ids(batch)}

  def get_initial_variables(
      self,
      rng: jax.Array,
      input_shapes: Mapping[str, Any],
      input_types: Optional[Mapping[str, Any]] = None,
  ) -> PyTree:
    """Initial variables from the input shapes (`[batch, length]` tokens).

    `network.init_variables`, as the built-in runner: the parameters depend
    only on the configuration. t5x's own shape for `task_ids` is ignored (its
    evaluator reports `[]` features of length 0).
    """
    del input_types  # placeholder tokens are int32
    batch, input_length = input_shapes['encoder_input_tokens']
    target_length = input_shapes['decoder_input_tokens'][1]
    variables = network.init_variables(self.module, rng, input_length,
                                       target_length, batch)
    if self.balancing is not None:
      variables.update(self._initial_balance(variables['params']))
    return flax.core.freeze(variables)  # as t5x's

  def _initial_balance(self, params: PyTree) -> dict[str, Any]:
    """MetaBalance's zero moving averages as a collection, with its axes."""
    shapes = metabalance.shared_state_shapes(self.balancing, params)._asdict()
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    flat = traverse_util.flatten_dict(shapes)
    axes = traverse_util.unflatten_dict({
        k[:-1] + (k[-1] + '_axes',):
            nn_partitioning.AxisMetadata(names=(None,) * len(v.shape))
        for k, v in flat.items()})
    return {METABALANCE: zeros, METABALANCE + '_axes': axes}

  def loss_fn(self, params: PyTree, batch: Mapping[str, jax.Array],
              dropout_rng: Optional[jax.Array], *flax_mutables):
    """t5x's loss and metrics (`EncoderDecoderModel.loss_fn`).

    Raises:
      ValueError: t5x's plain trainer steps a state holding MetaBalance's
        moving averages (its flax mutables).
    """
    if flax_mutables:
      raise ValueError(
          "The train state holds MetaBalance's moving averages "
          "(GRADIENT_BALANCING='metabalance'), and t5x's plain trainer is "
          'stepping it: select train.trainer_cls = '
          '@metabalance_trainer.MetaBalanceTrainer (add '
          '--gin_file=t5x/metabalance.gin).')
    return super().loss_fn(params, batch, dropout_rng)

  def eval_fn(self, params: PyTree, batch: Mapping[str, jax.Array],
              flax_mutables: Optional[PyTree] = None):
    """t5x's eval loss and metrics; the flax mutables do not enter the loss."""
    del flax_mutables
    return super().loss_fn(params, batch, None)

  def loss_shares(self, params: PyTree, batch: Mapping[str, jax.Array],
                  dropout_rng: Optional[jax.Array], in_share: jax.Array,
                  loss_normalizing_factor: Optional[Any] = None
                  ) -> tuple[jax.Array, Any]:
    """t5x's loss split into shares: `([shares] losses, metrics)`.

    Each share is t5x's weighted cross-entropy (as `loss_fn`) over its tokens
    only, so the shares sum to `loss_fn`'s loss; the metrics are `loss_fn`'s.

    Args:
      params: the parameters.
      batch: a t5x training batch.
      dropout_rng: dropout's rng.
      in_share: `[batch, target_length, shares]`, each target token's share
        (`metabalance.group_masks`).
      loss_normalizing_factor: the factor the losses are divided by (None:
        `batch`'s; a microbatch takes its whole batch's, `batch_factor`).

    Returns:
      `([shares] losses, metrics)`.
    """
    logits = self._compute_logits(params, batch, dropout_rng)
    targets = batch['decoder_target_tokens']
    factor, weights = t5x_losses.get_loss_normalizing_factor_and_weights(
        self._loss_normalizing_factor, batch)
    if loss_normalizing_factor is not None:
      factor = loss_normalizing_factor
    if weights is None:
      weights = jnp.ones(targets.shape, jnp.float32)

    def share(mask):
      loss, z_loss, _ = t5x_losses.compute_weighted_cross_entropy(
          logits, targets=targets, weights=weights * mask,
          label_smoothing=self._label_smoothing, z_loss=self._z_loss,
          loss_normalizing_factor=factor)
      return loss, z_loss

    # Over the masks only: the per-token losses, which do not depend on
    # them, are computed once.
    shares, z_shares = jax.vmap(share, in_axes=-1)(in_share)
    segment_ids = {k[:-len('_segment_ids')]: v for k, v in batch.items()
                   if k.endswith('_segment_ids')} or {
                       k: v != 0 for k, v in batch.items()
                       if k in ('encoder_input_tokens',
                                'decoder_target_tokens')}
    metrics = self._compute_metrics(
        logits=logits, targets=targets, mask=weights, loss=shares.sum(),
        z_loss=z_shares.sum(), segment_ids=segment_ids)
    return shares, metrics

  def batch_factor(self, batch: Mapping[str, jax.Array]) -> Any:
    """t5x's loss normalizing factor of a whole batch (None: none)."""
    return t5x_losses.get_loss_normalizing_factor_and_weights(
        self._loss_normalizing_factor, batch)[0]

  def token_task_ids(self, batch: Mapping[str, jax.Array]) -> jax.Array:
    """`[batch, target_length]`: the task id of each target token."""
    if 'decoder_task_ids' in batch:
      return batch['decoder_task_ids']
    return jnp.broadcast_to(self._task_ids(batch)[:, None],
                            batch['decoder_target_tokens'].shape)

  def _compute_logits(
      self,
      params: PyTree,
      batch: Mapping[str, jax.Array],
      dropout_rng: Optional[jax.Array] = None,
      mutable: Any = False,
      other_variables: Optional[PyTree] = None,
  ):
    """Teacher-forced logits as t5x's, with the batch's task ids."""
    rngs = {'dropout': dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {'params': params, **(other_variables or {})},
        batch['encoder_input_tokens'],
        batch['decoder_input_tokens'],
        batch['decoder_target_tokens'],
        encoder_segment_ids=batch.get('encoder_segment_ids'),
        decoder_segment_ids=batch.get('decoder_segment_ids'),
        encoder_positions=batch.get('encoder_positions'),
        decoder_positions=batch.get('decoder_positions'),
        decode=False,
        enable_dropout=rngs is not None,
        rngs=rngs,
        mutable=mutable,
        **self._task_id_inputs(batch),
    )

  def _compute_logits_from_slice(
      self,
      decoding_state: decoding.DecodingState,
      params: PyTree,
      encoded_inputs: jax.Array,
      raw_inputs: jax.Array,
      max_decode_length: int,
      task_ids: Optional[jax.Array] = None,
  ) -> tuple[jax.Array, PyTree]:
    """One decode step: `[batch * beams, 1]` tokens -> logits and the cache.

    `task_ids` are beam-expanded like `encoded_inputs`.
    """
    token = decoding_state.cur_token
    logits, new_vars = self.module.apply(
        {'params': params, 'cache': decoding_state.cache},
        encoded_inputs,
        raw_inputs,
        token,
        token,
        enable_dropout=False,
        decode=True,
        max_decode_length=max_decode_length,
        task_ids=task_ids,
        mutable=['cache'],
        method=self.module.decode,
    )
    return jnp.squeeze(logits, axis=1), new_vars['cache']

  def _compute_kv_cache(
      self,
      params: PyTree,
      encoded_inputs: jax.Array,
      encoder_input_tokens: jax.Array,
      decoder_input_tokens: jax.Array,
      prefill_decoder_prompt: bool = False,
      task_ids: Optional[jax.Array] = None,
  ) -> tuple[PyTree, None]:
    """`(cache, None)`: the empty decoding cache, made with the real task ids.

    `network.create_cache`, as the built-in decoder: one `decode` call over the
    full target shape that also stores what depends only on the task and
    `encoded`. Unlike t5x's, it goes through `decode` with `encoded_inputs`:
    t5x's re-run of the encoder on placeholder tokens would need task ids too
    and is wasted work. No prefill (`decode` has none).
    """
    if prefill_decoder_prompt:
      raise ValueError(
          'Prefilling the decoder prompt is not supported by '
          'hyperprompt_jax.model.network.Transformer.decode; call '
          'predict_batch_with_aux with prompt_with_targets=False.')
    cache = network.create_cache(self.module, params, encoded_inputs,
                                 encoder_input_tokens,
                                 decoder_input_tokens.shape[1], task_ids)
    return cache, None

  def predict_batch_with_aux(
      self,
      params: PyTree,
      batch: Mapping[str, jax.Array],
      rng: Optional[jax.Array] = None,
      decoder_params: Optional[MutableMapping[str, Any]] = None,
      return_all_decodes: Optional[bool] = None,
      num_decodes: Optional[int] = None,
      prompt_with_targets: bool = False,
  ) -> tuple[jax.Array, Mapping[str, jax.Array]]:
    """Decodes a batch with the model's `decode_fn` (t5x: beam search).

    Same arguments and results as `EncoderDecoderModel`'s (`num_decodes` is the
    beam size); the task ids enter the encoder, the cache and, beam-expanded,
    every decode step. No prompt prefill.

    Returns:
      `(decodes, {'scores': scores})`: `[batch, max_decode_length]` and
      `[batch]` for the best beam, or `[batch, num_decodes, ...]` with
      `return_all_decodes` (beams in increasing score).
    """
    defaults = self._default_decoder_params
    if return_all_decodes is None:
      return_all_decodes = defaults.return_all_decodes
    if num_decodes is None:
      num_decodes = defaults.num_decodes
    encoder_input_tokens = batch['encoder_input_tokens']
    decoder_input_tokens = batch['decoder_input_tokens']
    task_ids = self._task_ids(batch)
    if prompt_with_targets:
      # Force-decode the targets, EOS removed so that decoding goes on.
      prompt = decoder_input_tokens * (
          decoder_input_tokens != self.output_vocabulary.eos_id)
    else:
      prompt = jnp.zeros_like(decoder_input_tokens)

    encoded = self.module.apply(
        {'params': params}, encoder_input_tokens, enable_dropout=False,
        task_ids=task_ids, method=self.module.encode)
    cache, _ = self._compute_kv_cache(params, encoded, encoder_input_tokens,
                                      prompt, task_ids=task_ids)
    # Beam search runs on [batch * num_decodes] rows, each example repeated
    # in place ([a, b] -> [a, a, b, b]); so do its per-step inputs.
    expand = functools.partial(decoding.flat_batch_beam_expand,
                               beam_size=num_decodes)
    tokens_to_logits = functools.partial(
        self._compute_logits_from_slice,
        params=params,
        encoded_inputs=expand(encoded),
        raw_inputs=expand(encoder_input_tokens),
        max_decode_length=decoder_input_tokens.shape[1],
        task_ids=None if task_ids is None else expand(task_ids),
    )
    decoder_params = dict(decoder_params or {})
    if rng is not None:
      if decoder_params.get('decode_rng') is not None:
        raise ValueError(
            'Got an RNG both as `rng` and as decoder_params["decode_rng"]; '
            'pass only one.')
      decoder_params['decode_rng'] = rng
    if 'eos_id' not in decoder_params:  # read the vocabulary only if needed
      decoder_params['eos_id'] = self.output_vocabulary.eos_id or 1
    decodes, scores = self._decode_fn(
        inputs=prompt,
        cache=cache,
        tokens_to_logits=tokens_to_logits,
        num_decodes=num_decodes,
        cache_offset=0,  # no scanned layers
        **decoder_params,
    )
    if return_all_decodes:
      return decodes, {'scores': scores}
    return decodes[:, -1, :], {'scores': scores[:, -1]}


def converter_checks_batches(feature_converter_cls: Any,
                             config: network.T5Config) -> bool:
  """Whether every batch the converter makes is checked on the host.

  For a network of `config`, packed or not: task ids in `[0, num_tasks)`,
  and packed rows within HyperGrid's bound on examples a row.
  """
  bound = batches.RowFormat.of(config, pack=True).max_examples
  for pack in (False, True):
    try:
      converter = feature_converter_cls(pack=pack)
    except ValueError:  # e.g. pass-through features: t5x cannot pack then
      continue
    if not (isinstance(converter,
                       feature_converter.TaskIdsEncDecFeatureConverter)
            and converter.checks(config.num_tasks, bound)):
      return False
  return True


def __getattr__(name: str) -> Any:
  # MetaBalanceTrainer moved to its own module in 0.2: a gin file that still
  # names it here is told where (importing it here would tie the two
  # modules in a circle).
  if name == 'MetaBalanceTrainer':
    raise AttributeError(
        't5x_model.MetaBalanceTrainer moved to hyperprompt_jax.t5x.'
        'metabalance_trainer: in the gin file, `from hyperprompt_jax.t5x '
        'import metabalance_trainer` and '
        '`@metabalance_trainer.MetaBalanceTrainer` (gin/t5x/metabalance.gin).')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
