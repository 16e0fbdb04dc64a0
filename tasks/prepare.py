"""The TFDS datasets a mixture reads: which are prepared, and preparing them.

The library behind `python -m hyperprompt_jax.prepare_data`. The data
sources never download (`sources.PreparedTfdsDataSource`), so the data is
prepared once, here, with TFDS's own builders, into the directory the runs
read (`TFDS_DATA_DIR`, t5x's `--tfds_data_dir`, or TFDS's default).

  datasets_of('glue_super_glue_proportional')  # the 17 datasets, with the
                                               # tasks reading each
  is_prepared('glue/rte:2.0.0', data_dir)
  prepare('glue/rte:2.0.0', data_dir)          # network needed
"""

import dataclasses
import difflib
import logging
import socket
import time
import urllib.parse
from typing import Optional, Sequence

import seqio
import tensorflow_datasets as tfds


_PROG = 'python -m hyperprompt_jax.prepare_data'


class PrepareError(RuntimeError):
  """Preparing a dataset failed; the message names the cause and the fix."""


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A TFDS dataset ('name/config:version') and the tasks that read it."""
  tfds_name: str
  tasks: tuple[str, ...]


def datasets_of(mixture_or_task: str) -> list[Dataset]:
  """The distinct TFDS datasets the tasks of `mixture_or_task` read, by name.

  Tasks on other sources (the offline fixtures) read nothing to prepare and
  are left out.
  """
  known = [*seqio.MixtureRegistry.names(), *seqio.TaskRegistry.names()]
  if mixture_or_task not in known:
    close = difflib.get_close_matches(mixture_or_task, known, n=3)
    mixtures = sorted(n for n in seqio.MixtureRegistry.names()
                      if not n.startswith('fixture_'))
    raise ValueError(
        f'Unknown mixture or task {mixture_or_task!r}'
        + (f' (did you mean {", ".join(close)}?)' if close else '')
        + f'. Pass --mixture with a registered mixture ({", ".join(mixtures)})'
        ' or task (e.g. glue_rte), or a --gin_file whose '
        'MIXTURE_OR_TASK_NAME is one; a task of your own must be imported '
        'by the gin files to be registered.')
  provider = seqio.get_mixture_or_task(mixture_or_task)
  found = {}
  for task in getattr(provider, 'tasks', [provider]):
    name = tfds_name_of(task.source)
    if name is not None:
      found.setdefault(name, []).append(task.name)
  return [Dataset(n, tuple(sorted(t))) for n, t in sorted(found.items())]


def tfds_name_of(source: seqio.DataSource) -> Optional[str]:
  """The TFDS dataset a source reads ('glue/rte:2.0.0'), or None."""
  if not isinstance(source, seqio.TfdsDataSource):
    return None
  # seqio's own property: PreparedTfdsDataSource's fails on missing data.
  return seqio.TfdsDataSource.tfds_dataset.fget(source).name


class _QuietMissingVariants(logging.Filter):
  """Drops TFDS's warning on a dataset's missing files (the listing says so)."""

  def filter(self, record: logging.LogRecord) -> bool:
    """Whether to log `record`."""
    return not str(record.msg).startswith('Variant folder')


def is_prepared(tfds_name: str, data_dir: Optional[str]) -> bool:
  """Whether `tfds_name` is prepared in `data_dir` (None: TFDS's default).

  Reads the directory only, no download source.
  """
  quiet = _QuietMissingVariants()
  logger = logging.getLogger('absl')
  logger.addFilter(quiet)
  try:
    return tfds.builder(tfds_name, data_dir=data_dir).is_prepared()
  finally:
    logger.removeFilter(quiet)


def can_reach(hosts: Sequence[str], timeout_s: float = 10.) -> bool:
  """Whether any of `hosts` answers on HTTPS's port (True if none to try).

  Without network TFDS's downloader retries for minutes before it fails;
  this fails fast. One answer is enough: which hosts a dataset needs is
  TFDS's to find out.
  """
  for host in hosts:
    try:
      socket.create_connection((host, 443), timeout=timeout_s).close()
      return True
    except OSError:
      continue
  return not hosts


def _no_network_fix(try_gcs: bool) -> str:
  """How to prepare a dataset without network, in words."""
  gcs = '' if try_gcs else (
      ", or pass --try_gcs to copy TFDS's prepared copy from GCS")
  return ('prepare it on a machine with network access '
          f'(`{_PROG} --mixture=... --data_dir=DIR --prepare`) and copy DIR '
          f'here{gcs}.')


def prepare(tfds_name: str, data_dir: Optional[str],
            try_gcs: bool = False) -> None:
  """Prepares `tfds_name` in `data_dir` with TFDS's own builder.

  The builder downloads the dataset's sources (network needed).

  Args:
    tfds_name: 'name/config:version'.
    data_dir: the TFDS data directory; None: TFDS's default.
    try_gcs: first copy TFDS's public prepared copy from GCS.

  Raises:
    PrepareError: naming the dataset and the ways round a machine without
      network.
  """
  builder = tfds.builder(tfds_name, data_dir=data_dir)
  # The hosts of the dataset's checksum file (every config's URLs).
  hosts = sorted({urllib.parse.urlparse(url).hostname
                  for url in builder.url_infos or {}} - {None})
  if try_gcs:
    hosts.append('storage.googleapis.com')
  if not can_reach(hosts):
    raise PrepareError(
        f'Preparing {tfds_name} needs network access to its source '
        f'({", ".join(hosts)}), and none of these hosts answers: '
        + _no_network_fix(try_gcs))
  # Explicit: TFDS's DownloadConfig reads GCS by default; here only when the
  # user asks for it.
  config = tfds.download.DownloadConfig(try_download_gcs=try_gcs)
  try:
    builder.download_and_prepare(download_config=config)
  except Exception as e:  # pylint: disable=broad-except
    why = (str(e).strip().splitlines() or [''])[0][:300]
    raise PrepareError(
        f'Preparing {tfds_name} in {builder.data_dir_root} failed '
        f'({type(e).__name__}: {why}). TFDS downloads it from its source, '
        'which needs network access: ' + _no_network_fix(try_gcs)) from e


def _run_flags(data_dir: Optional[str]) -> str:
  """The flags that point the runs at `data_dir`, in words."""
  if data_dir is None:
    return 'The runs read TFDS\'s default directory: no flag needed.'
  return (f'Give the runs --gin.TFDS_DATA_DIR="\'{data_dir}\'" (t5x: '
          f'--tfds_data_dir={data_dir}).')


def run(mixture: str, data_dir: Optional[str], prepare_missing: bool = False,
        try_gcs: bool = False) -> int:
  """Lists the state of the datasets `mixture` reads, preparing if asked.

  Args:
    mixture: a registered mixture or task.
    data_dir: the TFDS data directory; None: TFDS's default.
    prepare_missing: prepare the missing ones (`prepare`).
    try_gcs: as `prepare`'s.

  Returns:
    The exit status: 1 while any is missing, else 0.
  """
  shown_dir = data_dir or (
      f'{tfds.core.constants.get_default_data_dir()} (TFDS\'s default)')
  datasets = datasets_of(mixture)
  if not datasets:
    print(f'{mixture} reads no TFDS dataset: nothing to prepare.')
    return 0
  prepared = {d.tfds_name: is_prepared(d.tfds_name, data_dir)
              for d in datasets}
  width = max(len(d.tfds_name) for d in datasets)
  print(f'TFDS datasets of {mixture} in {shown_dir}:')
  for d in datasets:
    state = 'prepared' if prepared[d.tfds_name] else 'missing'
    print(f'  {state:8}  {d.tfds_name:{width}}  {", ".join(d.tasks)}')
  missing = [d.tfds_name for d in datasets if not prepared[d.tfds_name]]
  print(f'{len(datasets) - len(missing)} of {len(datasets)} prepared.')
  if not prepare_missing:
    if missing:
      where = f' --data_dir={data_dir}' if data_dir else ''
      print(f'Prepare the {len(missing)} missing (network needed): {_PROG} '
            f'--mixture={mixture}{where} --prepare')
      return 1
    print(_run_flags(data_dir))
    return 0
  for i, name in enumerate(missing, 1):
    print(f'Preparing {name} ({i} of {len(missing)}) ...', flush=True)
    start = time.monotonic()
    prepare(name, data_dir, try_gcs=try_gcs)
    print(f'Prepared {name} in {time.monotonic() - start:.0f} s.', flush=True)
  print(f'All {len(datasets)} prepared in {shown_dir}. {_run_flags(data_dir)}')
  return 0
