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
  """`seqio.SentencePieceVocabulary` reading its model file's path from gin.

  Tasks are registered at import, before gin is parsed, so the path is
  resolved when seqio first loads the model, lazily.
  """

  def __init__(self, extra_ids: int = T5_EXTRA_IDS):
    super().__init__(T5_SENTENCEPIECE_MODEL, extra_ids=extra_ids)

  def _model_context(self):
    """seqio's model loader, the path resolved first."""
    if not self._model:
      self._sentencepiece_model_file = sentencepiece_model_file()
    return super()._model_context()

  @property
  def sentencepiece_model_file(self) -> str:
    """The model file: the loaded one's, else gin's."""
    if self._model:
      return self._sentencepiece_model_file
    return sentencepiece_model_file()

  def __getstate__(self):
    """seqio's state, naming the model file the vocabulary reads."""
    # seqio and t5x compare vocabularies by their state: naming the file
    # makes a loaded and an unloaded copy, or a plain
    # `seqio.SentencePieceVocabulary` of the same file, compare equal.
    state = super().__getstate__()
    state['_sentencepiece_model_file'] = self.sentencepiece_model_file
    return state


def _features(vocabulary: seqio.Vocabulary) -> dict[str, seqio.Feature]:
  """'inputs' (optional) and 'targets' of `vocabulary`, with EOS."""
  return {
      'inputs': seqio.Feature(vocabulary=vocabulary, add_eos=True,
                              required=False),
      'targets': seqio.Feature(vocabulary=vocabulary, add_eos=True),
  }


DEFAULT_OUTPUT_FEATURES = _features(GinSentencePieceVocabulary())
FIXTURE_OUTPUT_FEATURES = _features(seqio.ByteVocabulary())
