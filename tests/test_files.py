"""`files.write_atomically`: whole files replaced by a rename, empty ones
included (a resume that leaves no score line must still write its file)."""

import os

from hyperprompt_jax import files


def test_empty_content_replaces_a_file_and_leaves_no_temporary(tmp_path):
  path = tmp_path / 'scores.jsonl'
  path.write_text('{"step": 4}\n')
  files.write_atomically(str(path), '')
  assert path.read_bytes() == b''
  assert os.listdir(tmp_path) == ['scores.jsonl']


def test_text_and_bytes_are_written_whole_into_a_new_folder(tmp_path):
  text_path = tmp_path / 'new' / 'folder' / 'summary.json'
  files.write_atomically(str(text_path), '{"task": "glue_cola", "x": "é"}')
  assert text_path.read_text(encoding='utf-8') == (
      '{"task": "glue_cola", "x": "é"}')
  bytes_path = tmp_path / 'new' / 'params.npz'
  files.write_atomically(str(bytes_path), b'\x00\x01')
  assert bytes_path.read_bytes() == b'\x00\x01'
  assert sorted(os.listdir(tmp_path / 'new')) == ['folder', 'params.npz']
