"""Small files replaced whole: a reader sees the old content or the new, never
half of it, on a local disk and on GCS alike.

Every file the runner and the evaluators rewrite (scores, summaries, metric
lines, run records, task-parameter artifacts) goes through `write_atomically`.
`etils.epath` picks the file system by the path (`os` for local paths,
TensorFlow's gfile or fsspec for `gs://`), so this module needs no
TensorFlow; what it adds to epath is the write-aside-then-rename pattern,
which epath leaves to its callers.
"""

from typing import Union

from etils import epath

TEMPORARY_SUFFIX = '.tmp'


def write_atomically(path: str, content: Union[str, bytes]) -> None:
  """Writes `content` to `path` through `<path>.tmp` and a rename over it.

  Empty content is a file like any other (TensorFlow's `GFile` creates a
  file only when written to, so a loop that writes no line leaves nothing to
  rename; here the content is written in one call, empty or not). The
  folder is created if missing.

  Args:
    path: a local path or a `gs://` URL.
    content: the whole file: text (written as UTF-8) or bytes.
  """
  target = epath.Path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  temporary = target.parent / (target.name + TEMPORARY_SUFFIX)
  if isinstance(content, bytes):
    temporary.write_bytes(content)
  else:
    temporary.write_text(content, encoding='utf-8')
  temporary.replace(target)
