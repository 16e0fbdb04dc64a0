"""Host-side batch validation."""

import numpy as np
import pytest

from hyperprompt_jax.common import batches


def _batch(**overrides):
  batch = {
      'encoder_input_tokens': np.ones((2, 5), np.int32),
      'decoder_input_tokens': np.ones((2, 3), np.int32),
      'decoder_target_tokens': np.ones((2, 3), np.int32),
      'decoder_loss_weights': np.ones((2, 3), np.float32),
      'task_ids': np.array([0, 7], np.int32),
  }
  batch.update(overrides)
  return {k: v for k, v in batch.items() if v is not None}


def test_valid_batch_passes():
  batches.validate_batch(_batch(), num_tasks=8, vocab_size=384)


@pytest.mark.parametrize('overrides, message', [
    ({'task_ids': np.array([0, 8], np.int32)},
     r'task_ids has ids \[8\] outside \[0, num_tasks=8\)'),
    ({'task_ids': np.array([-1, 2], np.int32)}, r'ids \[-1\]'),
    ({'task_ids': None}, r"missing features \['task_ids'\]"),
    ({'task_ids': np.array([[0, 1]], np.int32)},
     "'task_ids' must have rank 1"),
    ({'task_ids': np.array([0.0, 1.0])}, "'task_ids' must be an integer"),
    ({'encoder_input_tokens': np.ones((2, 5, 1), np.int32)},
     "'encoder_input_tokens' must have rank 2"),
    ({'decoder_target_tokens': np.ones((3, 3), np.int32)},
     "'decoder_target_tokens' has batch size 3"),
    ({'decoder_input_tokens': np.full((2, 3), 384, np.int32)},
     r'outside \[0, vocab_size=384\)'),
])
def test_bad_batches_name_the_feature(overrides, message):
  with pytest.raises(ValueError, match=message):
    batches.validate_batch(_batch(**overrides), num_tasks=8, vocab_size=384)
