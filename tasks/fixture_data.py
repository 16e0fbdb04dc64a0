"""Learnable offline fixtures: examples made by rules from a seeded generator.

Each GLUE and SuperGLUE task (and DPR) gets a few hundred short examples in
its TFDS feature schema, labelled by a rule a small model can learn
(sentiment from word lists, entailment from templates, similarity from word
overlap, ...), with balanced classes, so a tiny model beats the majority
class clearly and a pipeline bug shows as a score drop. The files in
`tasks/fixtures/` are this module's output; regenerate them with

    python -m hyperprompt_jax.tasks.fixture_data

(`tests/test_tasks.py` checks that the shipped files equal a regeneration).
"""

import json
import os
import random
from typing import Callable

SEED = 20221122
TRAIN, VALIDATION = 400, 100
# Test splits, unlabelled as in TFDS (label -1, no ReCoRD answers), from
# their own generator so the train / validation files stay as they were.
TEST = 20

NOUNS = ('cat', 'dog', 'bird', 'horse', 'child', 'farmer', 'teacher', 'pilot',
         'doctor', 'singer', 'baker', 'sailor')
# Short names for the tasks with long inputs (MultiRC, ReCoRD), so every
# fixture input fits 128 bytes.
ANIMALS = ('cat', 'dog', 'bird', 'cow', 'fox', 'owl', 'bee', 'pig')
# MNLI's mismatched split draws its nouns from another "genre".
OTHER_NOUNS = ('robot', 'wizard', 'knight', 'dragon', 'queen', 'pirate')
ADJECTIVE_PAIRS = (('big', 'small'), ('hot', 'cold'), ('happy', 'sad'),
                   ('fast', 'slow'), ('old', 'young'), ('loud', 'quiet'),
                   ('rich', 'poor'), ('tall', 'short'))
ADJECTIVES = tuple(a for pair in ADJECTIVE_PAIRS for a in pair)
NEUTRAL_ADJECTIVES = ('famous', 'hungry', 'busy', 'tired', 'brave', 'clever')
VERBS = ('runs', 'sleeps', 'sings', 'reads', 'jumps', 'waits', 'swims',
         'cooks', 'paints', 'dances')
PLACES = ('park', 'city', 'garden', 'school', 'kitchen', 'forest', 'harbor',
          'market')
OBJECTS = ('apples', 'letters', 'songs', 'boats', 'bread', 'maps')
POSITIVE = ('great', 'wonderful', 'delightful', 'brilliant', 'charming',
            'superb', 'moving', 'lovely')
NEGATIVE = ('awful', 'terrible', 'boring', 'dreadful', 'dull', 'clumsy',
            'tedious', 'weak')
SUBJECTS = ('film', 'story', 'script', 'cast', 'ending', 'music', 'plot')


def _clause(rng, nouns=NOUNS):
  """A random noun, adjective, verb and place."""
  return {'noun': rng.choice(nouns), 'adj': rng.choice(ADJECTIVES),
          'verb': rng.choice(VERBS), 'place': rng.choice(PLACES)}


def _say(c) -> str:
  """The clause as a sentence."""
  return f"the {c['adj']} {c['noun']} {c['verb']} in the {c['place']} ."


def cola(rng, label):
  """acceptable (1): a well-ordered clause; unacceptable (0): scrambled."""
  words = _say(_clause(rng)).split()
  if label == 0:
    body = words[:-1]
    while body[:3] == words[:3]:
      rng.shuffle(body)
    words = body + ['.']
  return {'sentence': ' '.join(words)}


def sst2(rng, label):
  """positive (1) / negative (0) from the evaluative word."""
  word = rng.choice(POSITIVE if label else NEGATIVE)
  subject = rng.choice(SUBJECTS)
  template = rng.choice(('the {s} was {w} .', 'a {w} {s} about a {n} .',
                         'i found the {s} {w} and the {n} {v} .'))
  return {'sentence': template.format(s=subject, w=word, n=rng.choice(NOUNS),
                                      v=rng.choice(VERBS))}


def mrpc(rng, label):
  """equivalent (1): the clause reordered; not_equivalent (0): also negated."""
  c = _clause(rng)
  s1 = _say(c)
  subject = 'no' if label == 0 else 'the'
  s2 = f"in the {c['place']} , {subject} {c['adj']} {c['noun']} {c['verb']} ."
  return {'sentence1': s1, 'sentence2': s2}


def stsb(rng, _):
  """similarity = 5 x the fraction of the 4 content words kept; the others
  become 'thing' in the second sentence."""
  c = _clause(rng)
  keep = rng.randint(0, 4)
  slots = ['adj', 'noun', 'verb', 'place']
  rng.shuffle(slots)
  c2 = dict(c)
  for slot in slots[keep:]:
    c2[slot] = 'thing'
  return {'sentence1': _say(c), 'sentence2': _say(c2), 'label': 1.25 * keep}


def qqp(rng, label):
  """duplicate (1): the question asked another way; not (0): why, not how."""
  verb, obj = rng.choice(VERBS)[:-1], rng.choice(OBJECTS)
  q1 = f'how do i {verb} {obj} ?'
  if label == 0:
    q2 = f'why do people {verb} {obj} ?'
  else:
    q2 = f'what is the best way to {verb} {obj} ?'
  return {'question1': q1, 'question2': q2}


def mnli(rng, label, nouns=NOUNS):
  """entailment (0): the premise's adjective; contradiction (2): its
  antonym; neutral (1): an unrelated adjective."""
  c = _clause(rng, nouns)
  pair = next(p for p in ADJECTIVE_PAIRS if c['adj'] in p)
  adj = {0: c['adj'], 1: rng.choice(NEUTRAL_ADJECTIVES),
         2: pair[1 - pair.index(c['adj'])]}[label]
  return {'premise': _say(c), 'hypothesis': f"the {c['noun']} is {adj} ."}


def qnli(rng, label):
  """entailment (0): the sentence says what the question's noun does;
  not_entailment (1): it says nobody knows."""
  noun, verb, obj = rng.choice(NOUNS), rng.choice(VERBS), rng.choice(OBJECTS)
  question = f'what does the {noun} {verb[:-1]} ?'
  sentence = (f'the {noun} {verb} {obj} .' if label == 0
              else f'nobody knows what the {noun} {verb} .')
  return {'question': question, 'sentence': sentence}


def rte(rng, label):
  """entailment (0): the hypothesis repeats one conjunct; not_entailment
  (1): it denies it."""
  a, b = _clause(rng), _clause(rng)
  s1 = (f"the {a['noun']} {a['verb']} in the {a['place']} and the "
        f"{b['noun']} {b['verb']} .")
  verb = a['verb'] if label == 0 else f"does not {a['verb'][:-1]}"
  return {'sentence1': s1,
          'sentence2': f"the {a['noun']} {verb} in the {a['place']} ."}


def boolq(rng, label):
  """True (1): the question asks the passage's adjective; False (0): an
  adjective the passage does not use."""
  c = _clause(rng)
  adj = c['adj'] if label else rng.choice(NEUTRAL_ADJECTIVES)
  return {'passage': _say(c), 'question': f"is the {c['noun']} {adj} ?"}


def cb(rng, label):
  """MNLI's rule in CB's label order: entailment, contradiction, neutral."""
  return mnli(rng, {0: 0, 1: 2, 2: 1}[label])


CAUSES_EFFECTS = (
    ('hungry', 'skipped lunch', 'ate bread'),
    ('tired', 'worked all day', 'went to bed'),
    ('cold', 'lost a coat', 'lit a fire'),
    ('wet', 'walked in rain', 'dried off'),
    ('happy', 'won a prize', 'sang a song'),
    ('sick', 'ate bad fish', 'saw a nurse'),
)


ABSURD = ('flew to the moon', 'turned to glass', 'ate a cloud',
          'grew wheels', 'spoke to rocks', 'became a song')


def copa(rng, label):
  """choice1 (0) / choice2 (1): the cause (or effect) of the premise's
  state; the other choice is absurd."""
  state, cause, effect = rng.choice(CAUSES_EFFECTS)
  noun = rng.choice(NOUNS)
  question = rng.choice(('cause', 'effect'))
  right = f"it {cause if question == 'cause' else effect} ."
  wrong = f'it {rng.choice(ABSURD)} .'
  choices = (right, wrong) if label == 0 else (wrong, right)
  return {'premise': f'the {noun} was {state} .', 'question': question,
          'choice1': choices[0], 'choice2': choices[1]}


def multirc(rng, num_paragraphs):
  """Paragraphs placing an animal; per question 'where is the X ?' two
  answers, True (1) for the paragraph's place, False (0) for a thing that is
  no place. HTML line breaks and bold tags as in MultiRC."""
  out = []
  for p in range(num_paragraphs):
    noun, place = rng.choice(ANIMALS), rng.choice(PLACES)
    paragraph = (f'<b>the {noun}</b> is in the {place} .<br>it is '
                 f'{rng.choice(NEUTRAL_ADJECTIVES)} .')
    answers = [place, rng.choice(OBJECTS)]
    rng.shuffle(answers)
    for a, answer in enumerate(answers):
      out.append({'paragraph': paragraph,
                  'question': f'where is the {noun} ?', 'answer': answer,
                  'label': int(answer == place),
                  'idx': {'paragraph': p, 'question': p, 'answer': a}})
  return out


def record(rng, n):
  """The highlight says which entity the query's adjective describes."""
  out = []
  for i in range(n):
    n1, n2 = rng.sample(ANIMALS, 2)
    target, adj = rng.choice((n1, n2)), rng.choice(NEUTRAL_ADJECTIVES)
    passage = (f'{n1} met {n2} in the {rng.choice(PLACES)} .\n@highlight\n'
               f'{target} was {adj}')
    out.append({'passage': passage, 'query': f'@placeholder was {adj} .',
                'entities': [n1, n2], 'answers': [target],
                'idx': {'passage': i, 'query': i}})
  return out


def super_glue_rte(rng, label):
  """RTE's rule on SuperGLUE's premise / hypothesis features."""
  ex = rte(rng, label)
  return {'premise': ex['sentence1'], 'hypothesis': ex['sentence2']}


SENSES = {'bank': (('river', 'shore'), ('money', 'loan')),
          'bat': (('cave', 'wings'), ('ball', 'game')),
          'spring': (('water', 'well'), ('season', 'flowers')),
          'bark': (('tree', 'wood'), ('dog', 'noise')),
          'pitch': (('song', 'tune'), ('field', 'match'))}


def wic(rng, label):
  """The first sentence uses the word's first sense; True (1): the second
  sentence's context word is of the same sense, False (0): of the other."""
  word = rng.choice(sorted(SENSES))
  ctx1 = rng.choice(SENSES[word][0])
  ctx2 = rng.choice(SENSES[word][0 if label else 1])
  s1 = f'the {word} of the {ctx1} was {rng.choice(NEUTRAL_ADJECTIVES)} .'
  s2 = f'i saw the {word} by the {ctx2} .'
  return {'word': word, 'sentence1': s1, 'sentence2': s2,
          'start1': 4, 'end1': 4 + len(word),
          'start2': 10, 'end2': 10 + len(word)}


# The pronoun refers to the object when the adjective praises (the helper
# was kind) and to the subject when it thanks (the thanker was grateful).
OBJECT_ADJECTIVES = ('kind', 'generous', 'patient')
SUBJECT_ADJECTIVES = ('grateful', 'relieved', 'thankful')


def _pronoun_sentence(rng):
  """`(sentence, (subject, object), referent of 'he')`."""
  n1, n2 = rng.sample(NOUNS, 2)
  to_object = rng.random() < 0.5
  adj = rng.choice(OBJECT_ADJECTIVES if to_object else SUBJECT_ADJECTIVES)
  text = f'the {n1} thanked the {n2} because he was {adj} .'
  return text, (n1, n2), 1 if to_object else 0


def wsc(rng, label):
  """The candidate (span1) is the referent of 'he' (True, 1) or the other
  noun (False, 0); the adjective decides."""
  text, nouns, referent = _pronoun_sentence(rng)
  candidate = referent if label else 1 - referent
  return {'text': text, 'span1_text': nouns[candidate],
          'span1_index': 1 if candidate == 0 else 4,
          'span2_text': 'he', 'span2_index': 6}


def dpr(rng, label):
  """DPR: candidates (subject, object); label = the referent of 'he'."""
  while True:
    text, nouns, referent = _pronoun_sentence(rng)
    if referent == label:
      return {'sentence': text, 'pronoun': 'he', 'candidates': list(nouns)}


# fixture folder -> (rule, number of classes; 0 for the regression)
RULES: dict[str, tuple[Callable, int]] = {
    'glue_cola': (cola, 2),
    'glue_sst2': (sst2, 2),
    'glue_mrpc': (mrpc, 2),
    'glue_stsb': (stsb, 0),
    'glue_qqp': (qqp, 2),
    'glue_mnli': (mnli, 3),
    'glue_qnli': (qnli, 2),
    'glue_rte': (rte, 2),
    'super_glue_boolq': (boolq, 2),
    'super_glue_cb': (cb, 3),
    'super_glue_copa': (copa, 2),
    'super_glue_rte': (super_glue_rte, 2),
    'super_glue_wic': (wic, 2),
    'super_glue_wsc': (wsc, 2),
    'dpr': (dpr, 2),
}
# MultiRC (2 answers per paragraph) and ReCoRD make whole splits: see
# `generate`.


def _split(rng, rule, num_classes, n, **kwargs) -> list[dict]:
  """`n` examples of `rule`, classes balanced, shuffled."""
  out = []
  for idx in range(n):
    label = idx % num_classes if num_classes else None
    ex = rule(rng, label, **kwargs)
    if num_classes:
      ex['label'] = label
    if rule is not dpr:  # TFDS's DPR has no idx.
      ex['idx'] = idx
    out.append(ex)
  rng.shuffle(out)
  return out


def generate() -> dict[str, dict[str, list[dict]]]:
  """fixture folder -> split file stem -> examples (TFDS schema)."""
  rng = random.Random(SEED)
  data = {}
  for name, (rule, k) in RULES.items():
    if name == 'glue_mnli':
      data[name] = {
          'train': _split(rng, rule, k, TRAIN),
          'validation_matched': _split(rng, rule, k, VALIDATION),
          'validation_mismatched': _split(rng, rule, k, VALIDATION,
                                          nouns=OTHER_NOUNS),
      }
    elif name == 'dpr':  # DPR has no validation split.
      data[name] = {'train': _split(rng, rule, k, TRAIN),
                    'test': _split(rng, rule, k, VALIDATION)}
    else:
      data[name] = {'train': _split(rng, rule, k, TRAIN),
                    'validation': _split(rng, rule, k, VALIDATION)}
  data['super_glue_multirc'] = {'train': multirc(rng, TRAIN // 2),
                                'validation': multirc(rng, VALIDATION // 2)}
  data['super_glue_record'] = {'train': record(rng, TRAIN),
                               'validation': record(rng, VALIDATION)}
  _add_test_splits(data, random.Random(SEED + 1))
  return data


def _unlabelled(examples: list[dict]) -> list[dict]:
  """TFDS's test splits: label -1, ReCoRD without answers."""
  out = []
  for ex in examples:
    ex = dict(ex)
    if 'label' in ex:
      ex['label'] = -1
    if 'answers' in ex:
      ex['answers'] = []
    out.append(ex)
  return out


def _add_test_splits(data: dict, rng: random.Random) -> None:
  """Adds unlabelled test splits, for the test-server files (`leaderboard`)."""
  for name, (rule, k) in RULES.items():
    if name == 'glue_mnli':
      data[name]['test_matched'] = _unlabelled(_split(rng, rule, k, TEST))
      data[name]['test_mismatched'] = _unlabelled(
          _split(rng, rule, k, TEST, nouns=OTHER_NOUNS))
    elif name != 'dpr':
      data[name]['test'] = _unlabelled(_split(rng, rule, k, TEST))
  data['super_glue_multirc']['test'] = _unlabelled(multirc(rng, TEST // 2))
  data['super_glue_record']['test'] = _unlabelled(record(rng, TEST))


def to_jsonl(examples: list[dict]) -> str:
  """One JSON line per example."""
  return ''.join(json.dumps(ex, sort_keys=True) + '\n' for ex in examples)


def main() -> None:
  """Writes the fixture files."""
  root = os.path.join(os.path.dirname(__file__), 'fixtures')
  for name, splits in generate().items():
    os.makedirs(os.path.join(root, name), exist_ok=True)
    for split, examples in splits.items():
      with open(os.path.join(root, name, f'{split}.jsonl'), 'w') as f:
        f.write(to_jsonl(examples))
  print(f'wrote {root}')


if __name__ == '__main__':
  main()
