"""The joint GLUE + SuperGLUE mixture's 17 TFDS datasets, prepared by TFDS's
own builders from a few hand-written rows in each dataset's raw download
format (GLUE's TSVs, MRPC's and DPR's text files, SuperGLUE's JSON lines).

The builders' downloads are replaced by local files (no network): TFDS's
`DownloadManager.download_and_extract` returns the folder a GLUE / SuperGLUE
zip extracts to, `download` the local copy of each URL the builder names
(MRPC, DPR). The formats follow TFDS 4.9's builders
(`tensorflow_datasets/text/glue.py`, `super_glue.py`,
`definite_pronoun_resolution.py`: `_split_generators`, `_generate_examples`).

  sources = write_sources(root)     # raw files, the SentencePiece corpus
  prepare_all(sources, data_dir)    # the 17 datasets, by the real builders

Rows per split (tests/test_real_mixture.py writes its expectations from
them): train 4 (SST-2, ReCoRD, DPR 3; MultiRC 2 paragraphs), validation 2
(MNLI mismatched 3; MultiRC 1 paragraph), test 2 or 3; every MultiRC
paragraph has 2 questions of 2 answers, every ReCoRD query one answer.
"""

import dataclasses
import json
import pathlib
from typing import Any
from unittest import mock

import tensorflow_datasets as tfds

DATASETS = (
    'definite_pronoun_resolution:1.1.0',
    'glue/cola:2.0.0', 'glue/mnli:2.0.0', 'glue/mrpc:2.0.0', 'glue/qnli:2.0.0',
    'glue/qqp:2.0.0', 'glue/rte:2.0.0', 'glue/sst2:2.0.0', 'glue/stsb:2.0.0',
    'super_glue/boolq:1.0.2', 'super_glue/cb:1.0.2', 'super_glue/copa:1.0.2',
    'super_glue/multirc:1.0.2', 'super_glue/record:1.0.2',
    'super_glue/rte:1.0.2', 'super_glue/wic:1.0.2',
    'super_glue/wsc.fixed:1.0.2')

_S = ('Dana sleeps in the park.', 'The cat runs home.', 'A dog eats food.',
      'Tom reads a long book.', 'The sun is very hot today.',
      'Ann walks to the old school.')


def _tsv(path: pathlib.Path, header, rows, bom: bool = False) -> None:
  lines = (['\t'.join(header)] if header else []) + [
      '\t'.join(str(c) for c in r) for r in rows]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(('\ufeff' if bom else '') + '\n'.join(lines) + '\n',
                  encoding='utf-8')


def _jsonl(path: pathlib.Path, rows) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))


def _pairs(n, start=0):
  return [(_S[(start + i) % 6], _S[(start + i + 1) % 6]) for i in range(n)]


def _glue(glue: pathlib.Path) -> None:
  """GLUE's extracted zips: <glue>/<data_dir>/{train,dev,test}.tsv."""
  _tsv(glue / 'CoLA/train.tsv', None, [
      ('gj04', 1, '', _S[0]), ('gj04', 0, '*', 'Sleeps Dana park the.'),
      ('gj04', 1, '', _S[2]), ('gj04', 0, '*', 'Home runs cat the.')])
  _tsv(glue / 'CoLA/dev.tsv', None, [('gj04', 1, '', _S[3]),
                                     ('gj04', 0, '*', 'Book a Tom.')])
  _tsv(glue / 'CoLA/test.tsv', ('index', 'sentence'),
       [(i, s) for i, s in enumerate(_S[:3])])
  _tsv(glue / 'SST-2/train.tsv', ('sentence', 'label'),
       [('a gorgeous film', 1), ('a dull mess', 0), ('fine acting', 1)])
  _tsv(glue / 'SST-2/dev.tsv', ('sentence', 'label'),
       [('a lovely story', 1), ('boring', 0)])
  _tsv(glue / 'SST-2/test.tsv', ('index', 'sentence'),
       [(0, 'great fun'), (1, 'too long')])
  qqp = ('id', 'qid1', 'qid2', 'question1', 'question2', 'is_duplicate')
  _tsv(glue / 'QQP/train.tsv', qqp, [
      (i, 2 * i, 2 * i + 1, f'Why does {a}?', f'Why is {b}?', i % 2)
      for i, (a, b) in enumerate(_pairs(4))])
  _tsv(glue / 'QQP/dev.tsv', qqp, [
      (i, 2 * i, 2 * i + 1, f'How {a}?', f'How {b}?', i % 2)
      for i, (a, b) in enumerate(_pairs(2, 3))])
  _tsv(glue / 'QQP/test.tsv', ('id', 'question1', 'question2'),
       [(i, f'Is {a}?', f'Is {b}?') for i, (a, b) in enumerate(_pairs(2))])
  stsb = ('index', 'genre', 'sentence1', 'sentence2', 'score')
  _tsv(glue / 'STS-B/train.tsv', stsb, [
      (i, 'main-news', a, b, f'{i * 1.4:.3f}')
      for i, (a, b) in enumerate(_pairs(4))])
  _tsv(glue / 'STS-B/dev.tsv', stsb, [
      (i, 'main-news', a, b, f'{4.8 - i:.3f}')
      for i, (a, b) in enumerate(_pairs(2, 2))])
  _tsv(glue / 'STS-B/test.tsv', stsb[:4],
       [(i, 'main-news', a, b) for i, (a, b) in enumerate(_pairs(3, 1))])
  mnli = ('index', 'genre', 'sentence1', 'sentence2', 'gold_label')
  nli3 = ('entailment', 'neutral', 'contradiction')
  _tsv(glue / 'MNLI/train.tsv', mnli, [
      (i, 'fiction', a, b, nli3[i % 3]) for i, (a, b) in enumerate(_pairs(4))])
  for kind, n in (('matched', 2), ('mismatched', 3)):
    _tsv(glue / f'MNLI/dev_{kind}.tsv', mnli, [
        (i, 'slate', a, b, nli3[i % 3])
        for i, (a, b) in enumerate(_pairs(n, 2))])
    _tsv(glue / f'MNLI/test_{kind}.tsv', mnli[:4], [
        (i, 'slate', a, b) for i, (a, b) in enumerate(_pairs(n, 3))])
  nli2 = ('entailment', 'not_entailment')
  qnli = ('index', 'question', 'sentence', 'label')
  _tsv(glue / 'QNLI/train.tsv', qnli, [
      (i, f'Who {a}?', b, nli2[i % 2]) for i, (a, b) in enumerate(_pairs(4))])
  _tsv(glue / 'QNLI/dev.tsv', qnli, [
      (i, f'Who {a}?', b, nli2[i % 2])
      for i, (a, b) in enumerate(_pairs(2, 1))])
  _tsv(glue / 'QNLI/test.tsv', qnli[:3],
       [(i, f'Who {a}?', b) for i, (a, b) in enumerate(_pairs(2, 4))])
  rte = ('index', 'sentence1', 'sentence2', 'label')
  _tsv(glue / 'RTE/train.tsv', rte, [
      (i, a, b, nli2[i % 2]) for i, (a, b) in enumerate(_pairs(4))])
  _tsv(glue / 'RTE/dev.tsv', rte, [
      (i, a, b, nli2[i % 2]) for i, (a, b) in enumerate(_pairs(2, 2))])
  _tsv(glue / 'RTE/test.tsv', rte[:3],
       [(i, a, b) for i, (a, b) in enumerate(_pairs(3, 3))])


def _mrpc(files: pathlib.Path) -> dict[str, pathlib.Path]:
  """MRPC's three files: the train file (with its UTF-8 BOM, which the
  builder skips) holds train + dev, the dev ids pick the dev rows."""
  header = ('Quality', '#1 ID', '#2 ID', '#1 String', '#2 String')
  rows = [(i % 2, 100 + i, 200 + i, a, b)
          for i, (a, b) in enumerate(_pairs(6))]
  paths = {k: files / f'mrpc_{k}.txt' for k in ('train', 'dev_ids', 'test')}
  _tsv(paths['train'], header, rows, bom=True)
  _tsv(paths['dev_ids'], None, [(100 + i, 200 + i) for i in (1, 4)])
  _tsv(paths['test'], header, [(0, 300 + i, 400 + i, a, b)
                               for i, (a, b) in enumerate(_pairs(2, 3))])
  return paths


def _dpr(files: pathlib.Path) -> dict[str, pathlib.Path]:
  """DPR: sentence, pronoun, 'cand1,cand2', the referent, a blank line."""
  items = [('Bob asked Tom if he can lend some money.', 'he', 'Bob,Tom',
            'Tom'),
           ('The cup fell on the plate because it was heavy.', 'it',
            'cup,plate', 'cup'),
           ('Ann thanked Mia because she helped.', 'she', 'Ann,Mia', 'Mia')]
  paths = {k: files / f'dpr_{k}.c.txt' for k in ('train', 'test')}
  for split, rows in (('train', items), ('test', items[:2])):
    paths[split].write_text(''.join('\n'.join(r) + '\n\n' for r in rows))
  return paths


def _super_glue(sg: pathlib.Path) -> None:
  """SuperGLUE's extracted zips: <sg>/<Task>/{train,val,test}.jsonl."""

  def write(task, make, counts=(4, 2, 2)):
    for split, n in zip(('train', 'val', 'test'), counts):
      _jsonl(sg / task / f'{split}.jsonl',
             [make(i, None if split == 'test' else i % 2) for i in range(n)])

  def labelled(row, label):
    return row if label is None else {**row, 'label': label}

  write('BoolQ', lambda i, y: labelled(
      {'idx': i, 'question': f'is {_S[i][:-1].lower()}',
       'passage': _S[(i + 1) % 6]}, None if y is None else bool(y)))
  cb = ('entailment', 'contradiction', 'neutral')
  write('CB', lambda i, y: labelled(
      {'idx': i, 'premise': _S[i], 'hypothesis': _S[i + 1]},
      None if y is None else cb[i % 3]), (4, 2, 3))
  write('COPA', lambda i, y: labelled(
      {'idx': i, 'premise': _S[i], 'choice1': _S[i + 1],
       'choice2': _S[i + 2], 'question': ('cause', 'effect')[i % 2]}, y))
  write('RTE', lambda i, y: labelled(
      {'idx': i, 'premise': _S[i], 'hypothesis': _S[i + 1]},
      None if y is None else ('entailment', 'not_entailment')[y]))
  write('WiC', lambda i, y: labelled(
      {'idx': i, 'word': 'park', 'sentence1': 'I park the car.',
       'sentence2': 'We walk in the park.', 'start1': 2, 'end1': 6,
       'start2': 15, 'end2': 19}, None if y is None else bool(y)))
  wsc = [('Mitchell asked Tom if he could lend some money.', 'Tom', 2, 'he', 4),
         ('The cup fell on the plate because it was heavy.', 'The cup', 0,
          'it', 7)]
  write('WSC', lambda i, y: labelled(
      {'idx': i, 'text': wsc[i % 2][0], 'target': {
          'span1_text': wsc[i % 2][1], 'span1_index': wsc[i % 2][2],
          'span2_text': wsc[i % 2][3], 'span2_index': wsc[i % 2][4]}},
      None if y is None else bool((i + 1) % 2)))

  def multirc(i, y):
    questions = [{'idx': q, 'question': f'Who {q}?', 'answers': [
        labelled({'idx': a, 'text': _S[(i + q + a) % 6]},
                 None if y is None else (a + q) % 2)
        for a in range(2)]} for q in range(2)]
    return {'idx': i, 'passage': {'text': _S[i] + ' ' + _S[i + 1],
                                  'questions': questions}}
  write('MultiRC', multirc, (2, 1, 2))

  def record(split, n_queries, qid):
    # One passage; entities by character offsets (end inclusive).
    text = 'Dana met Tom in Paris.\n@highlight\nTom smiled'
    entities = [{'start': 0, 'end': 3}, {'start': 9, 'end': 11},
                {'start': 16, 'end': 20}]
    qas = []
    for q in range(n_queries):
      qa = {'idx': qid + q, 'query': '@placeholder met Tom in Paris.'}
      if split != 'test':
        qa['answers'] = [{'start': 0, 'end': 3, 'text': 'Dana'}]
      qas.append(qa)
    return {'idx': 0, 'source': 'cnn', 'passage': {'text': text,
                                                   'entities': entities},
            'qas': qas}
  for split, n in (('train', 3), ('val', 2), ('test', 3)):
    _jsonl(sg / 'ReCoRD' / f'{split}.jsonl', [record(split, n, 0)])


@dataclasses.dataclass(frozen=True)
class Sources:
  root: pathlib.Path
  glue: pathlib.Path           # what GLUE's zips extract to
  super_glue: pathlib.Path     # what SuperGLUE's zips extract to
  files: dict[str, pathlib.Path]  # URL fragment -> local copy

  def corpus(self) -> str:
    """Every raw file's text (a SentencePiece training corpus)."""
    return '\n'.join(p.read_text(encoding='utf-8')
                     for p in sorted(self.root.rglob('*')) if p.is_file())


def write_sources(root: pathlib.Path) -> Sources:
  files = root / 'files'
  files.mkdir(parents=True)
  _glue(root / 'glue')
  _super_glue(root / 'super_glue')
  mrpc, dpr = _mrpc(files), _dpr(files)
  return Sources(root, root / 'glue', root / 'super_glue', {
      'mrpc_dev_ids': mrpc['dev_ids'], 'msr_paraphrase_train': mrpc['train'],
      'msr_paraphrase_test': mrpc['test'],
      'definite_pronoun_resolution/train': dpr['train'],
      'definite_pronoun_resolution/test': dpr['test']})


def prepare_all(sources: Sources, data_dir: str) -> None:
  """Prepares the 17 datasets in `data_dir` with TFDS's builders, their
  downloads answered from `sources`."""

  def local(url: str) -> str:
    (path,) = [p for k, p in sources.files.items() if k in url]
    return str(path)

  def download(self, urls: Any):
    del self
    if isinstance(urls, dict):
      return {k: local(u) for k, u in urls.items()}
    return local(urls)

  def download_and_extract(self, url: Any):
    del self
    assert isinstance(url, str), url
    return str(sources.super_glue if '/superglue/' in url else sources.glue)

  manager = tfds.download.DownloadManager
  with mock.patch.object(manager, 'download', download), \
       mock.patch.object(manager, 'download_and_extract', download_and_extract):
    for name in DATASETS:
      tfds.builder(name, data_dir=data_dir).download_and_prepare(
          download_config=tfds.download.DownloadConfig(try_download_gcs=False))


RTE_ROWS = ('index\tsentence1\tsentence2\tlabel',
            '0\tDana sleeps in the park.\tDana sleeps.\tentailment',
            '1\tThe cat runs home.\tThe dog runs.\tnot_entailment')


def rte_download(root: pathlib.Path) -> str:
  """GLUE's RTE folder alone, as TFDS extracts RTE.zip (`RTE_ROWS` for
  train, their first for dev, one unlabelled test row), under `root`;
  returns what `download_and_extract` gives glue/rte's builder."""
  src = root / 'download' / 'RTE'
  src.mkdir(parents=True)
  (src / 'train.tsv').write_text('\n'.join(RTE_ROWS) + '\n')
  (src / 'dev.tsv').write_text('\n'.join(RTE_ROWS[:2]) + '\n')
  (src / 'test.tsv').write_text('index\tsentence1\tsentence2\n0\tA b.\tC d.\n')
  return str(src.parent)
