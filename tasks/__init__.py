"""The project's seqio tasks and mixtures (installed as hyperprompt_jax.tasks).

Importing this package registers T5's GLUE and SuperGLUE tasks, their
proportional mixtures (and the joint one) and the offline `fixture_*` tasks.
Every example carries `task_ids` (int32 scalar), a stable id from
`task_ids.run_task_list`. Feed them to a model through
`TaskIdsEncDecFeatureConverter`; add your own tasks with `add_task`
(docs/tasks.md).
"""

from hyperprompt_jax.tasks import glue
from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import scores
from hyperprompt_jax.tasks import super_glue
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.tasks.feature_converter import TaskIdsEncDecFeatureConverter
from hyperprompt_jax.tasks.features import DEFAULT_OUTPUT_FEATURES
from hyperprompt_jax.tasks.features import FIXTURE_OUTPUT_FEATURES
from hyperprompt_jax.tasks.registration import EVAL_ONLY
from hyperprompt_jax.tasks.registration import TaskIdsMixture
from hyperprompt_jax.tasks.registration import add_mixture
from hyperprompt_jax.tasks.registration import add_task
from hyperprompt_jax.tasks.registration import add_to_mixture
from hyperprompt_jax.tasks.task_ids import check_num_tasks
from hyperprompt_jax.tasks.task_ids import run_task_list
from hyperprompt_jax.tasks.task_ids import task_id

glue.register_all()
super_glue.register_all()
