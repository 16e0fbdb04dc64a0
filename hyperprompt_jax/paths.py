"""Where the package's data lives: `python -m hyperprompt_jax.paths gin`.

Prints the directory of the shipped gin files, for t5x's
`--gin_search_paths=$(python -m hyperprompt_jax.paths gin)`.
"""

import os
import sys
import uuid

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def gin_dir() -> str:
  """The shipped gin directory (`models/`, `variants/`, `t5x/`, ...).

  In a normal install the files live in the package (`hyperprompt_jax/gin`);
  in an editable install (`pip install -e .`) they are read from the
  checkout's top-level `gin/`.
  """
  for candidate in (
      os.path.join(_PACKAGE_DIR, 'gin'),
      os.path.join(os.path.dirname(_PACKAGE_DIR), 'gin'),
  ):
    if os.path.isdir(os.path.join(candidate, 'models')):
      return candidate
  raise FileNotFoundError(
      'The hyperprompt_jax gin files are missing: reinstall the package '
      '(pip install hyperprompt_jax, or pip install -e . in a checkout).'
  )


def check_writable_dir(path: str, macro: str) -> None:
  """Fails early, before any work, if the directory `macro` names cannot be
  created or written."""
  try:
    os.makedirs(path, exist_ok=True)
    # A name of this process's own: the hosts of a run check the same
    # directory at once.
    probe = os.path.join(path, f'.write_test-{uuid.uuid4().hex}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ValueError(f'{macro} {path!r} is not writable ({e}); pass '
                     f'--gin.{macro}="\'/a/writable/dir\'".') from None


def main(argv: list[str]) -> int:
  if argv[1:] != ['gin']:
    print('usage: python -m hyperprompt_jax.paths gin', file=sys.stderr)
    return 2
  print(gin_dir())
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
