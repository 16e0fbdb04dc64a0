"""Learnable offline fixtures: examples made by rules from a seeded generator.

Each GLUE task gets a few hundred short examples in its TFDS feature schema,
labelled by a rule a small model can learn (sentiment from word lists,
entailment from templates, similarity from word overlap, ...), with balanced
classes, so a tiny model trained for minutes beats the majority class clearly
and a bug in the pipeline shows as a score drop. The files in
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

NOUNS = ('cat', 'dog', 'bird', 'horse', 'child', 'farmer', 'teacher', 'pilot',
         'doctor', 'singer', 'baker', 'sailor')
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


def _other(rng: random.Random, options, not_this):
  return rng.choice([o for o in options if o != not_this])


def _clause(rng, nouns=NOUNS):
  return {'noun': rng.choice(nouns), 'adj': rng.choice(ADJECTIVES),
          'verb': rng.choice(VERBS), 'place': rng.choice(PLACES)}


def _say(c) -> str:
  return f"the {c['adj']} {c['noun']} {c['verb']} in the {c['place']} ."


def cola(rng, label):
  """acceptable (1): determiner-adjective-noun-verb order; unacceptable (0):
  the same words scrambled."""
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
  """equivalent (1): the same clause reordered; not_equivalent (0): a
  clause with another noun and place."""
  c = _clause(rng)
  s1 = _say(c)
  if label == 0:
    c = dict(c, noun=_other(rng, NOUNS, c['noun']),
             place=_other(rng, PLACES, c['place']))
  s2 = f"in the {c['place']} , the {c['adj']} {c['noun']} {c['verb']} ."
  return {'sentence1': s1, 'sentence2': s2}


def stsb(rng, _):
  """similarity = 5 x the fraction of the 4 content words kept."""
  c = _clause(rng)
  keep = rng.randint(0, 4)
  slots = ['adj', 'noun', 'verb', 'place']
  rng.shuffle(slots)
  pools = {'adj': ADJECTIVES, 'noun': NOUNS, 'verb': VERBS, 'place': PLACES}
  c2 = dict(c)
  for slot in slots[keep:]:
    c2[slot] = _other(rng, pools[slot], c[slot])
  return {'sentence1': _say(c), 'sentence2': _say(c2), 'label': 1.25 * keep}


def qqp(rng, label):
  """duplicate (1): the same verb and object asked another way."""
  verb, obj = rng.choice(VERBS)[:-1], rng.choice(OBJECTS)
  q1 = f'how do i {verb} {obj} ?'
  if label == 0:
    if rng.random() < 0.5:
      verb = _other(rng, [v[:-1] for v in VERBS], verb)
    else:
      obj = _other(rng, OBJECTS, obj)
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
  """entailment (0): the sentence answers the question (same noun and verb);
  not_entailment (1): it is about another noun."""
  noun, verb, obj = rng.choice(NOUNS), rng.choice(VERBS), rng.choice(OBJECTS)
  question = f'what does the {noun} {verb[:-1]} ?'
  if label == 1:
    noun = _other(rng, NOUNS, noun)
  return {'question': question, 'sentence': f'the {noun} {verb} {obj} .'}


def rte(rng, label):
  """entailment (0): the hypothesis repeats one conjunct; not_entailment
  (1): it moves that conjunct to another place."""
  a, b = _clause(rng), _clause(rng)
  s1 = (f"the {a['noun']} {a['verb']} in the {a['place']} and the "
        f"{b['noun']} {b['verb']} .")
  place = a['place'] if label == 0 else _other(rng, PLACES, a['place'])
  return {'sentence1': s1,
          'sentence2': f"the {a['noun']} {a['verb']} in the {place} ."}


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
}


def _split(rng, rule, num_classes, n, **kwargs) -> list[dict]:
  out = []
  for idx in range(n):
    label = idx % num_classes if num_classes else None
    ex = rule(rng, label, **kwargs)
    if num_classes:
      ex['label'] = label
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
    else:
      data[name] = {'train': _split(rng, rule, k, TRAIN),
                    'validation': _split(rng, rule, k, VALIDATION)}
  return data


def to_jsonl(examples: list[dict]) -> str:
  return ''.join(json.dumps(ex, sort_keys=True) + '\n' for ex in examples)


def main() -> None:
  root = os.path.join(os.path.dirname(__file__), 'fixtures')
  for name, splits in generate().items():
    os.makedirs(os.path.join(root, name), exist_ok=True)
    for split, examples in splits.items():
      with open(os.path.join(root, name, f'{split}.jsonl'), 'w') as f:
        f.write(to_jsonl(examples))
  print(f'wrote {root}')


if __name__ == '__main__':
  main()
