"""Output features (vocabularies) of the project's tasks.

Real tasks use T5's SentencePiece vocabulary (32 000 pieces + 100 sentinels,
the vocabulary of every public T5 / T5.1.1 checkpoint). Its model file is
gin-settable, e.g. a local copy on a machine without GCS access:

    hyperprompt_jax.tasks.features.sentencepiece_model_file.path = '/data/spm.model'

The offline fixtures use `seqio.ByteVocabulary` (259 ids, inside the tiny
model's 384), which needs no file.
"""

import gin
import seqio

T5_SENTENCEPIECE_MODEL = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'
T5_EXTRA_IDS = 100


@gin.configurable(module='hyperprompt_jax.tasks.features')
def sentencepiece_model_file(path: str = T5_SENTENCEPIECE_MODEL) -> str:
  """The SentencePiece model of the real tasks (default: T5's, on GCS)."""
  return path


class GinSentencePieceVocabulary(seqio.SentencePieceVocabulary):
  """`seqio.SentencePieceVocabulary` whose model file is read from gin when
  the model is first loaded.

  Tasks are registered at import, before gin is parsed, so the path cannot be
  a constructor argument; seqio loads the model lazily, and we resolve the
  path at that moment.
  """

  def __init__(self, extra_ids: int = T5_EXTRA_IDS):
    super().__init__(T5_SENTENCEPIECE_MODEL, extra_ids=extra_ids)

  def _model_context(self):
    if not self._model:
      self._sentencepiece_model_file = sentencepiece_model_file()
    return super()._model_context()

  @property
  def sentencepiece_model_file(self) -> str:
    if self._model:
      return self._sentencepiece_model_file
    return sentencepiece_model_file()

  def __getstate__(self):
    # seqio compares vocabularies by their state (t5x's
    # `verify_matching_vocabs` too): the state names the file the model is,
    # or will be, read from, so that a loaded and an unloaded copy, or a
    # plain `seqio.SentencePieceVocabulary` of the same file, compare equal.
    state = super().__getstate__()
    state['_sentencepiece_model_file'] = self.sentencepiece_model_file
    return state


def _features(vocabulary: seqio.Vocabulary) -> dict[str, seqio.Feature]:
  return {
      'inputs': seqio.Feature(vocabulary=vocabulary, add_eos=True,
                              required=False),
      'targets': seqio.Feature(vocabulary=vocabulary, add_eos=True),
  }


DEFAULT_OUTPUT_FEATURES = _features(GinSentencePieceVocabulary())
FIXTURE_OUTPUT_FEATURES = _features(seqio.ByteVocabulary())
