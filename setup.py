"""Install hyperprompt_jax: `pip install -e '.[test]'` in a checkout."""

import setuptools

# Versions that resolve together from the package index and that t5x's current
# source runs with (jax 0.10 / flax 0.12); the t5x test data was written with
# the same jax / flax / orbax versions.
INSTALL_REQUIRES = [
    'jax==0.10.2',
    'jaxlib==0.10.2',
    'flax==0.12.8',
    'optax==0.2.8',
    'orbax-checkpoint==0.12.8',
    'tensorstore==0.1.86',
    'seqio==0.0.20',
    # tensorflow-text (seqio's) requires `tensorflow` itself; tensorflow-cpu
    # beside it would unpack a second copy over the same folder.
    'tensorflow==2.21.0',
    'tensorflow-text==2.21.1',
    'tensorflow-datasets==4.9.10',
    'importlib_resources==7.1.0',
    'gin-config==0.5.0',
    'clu==0.0.12',
    'tensorboard==2.21.0',  # clu's metric writers write TensorBoard summaries
    'sentencepiece==0.2.3',
    'scikit-learn==1.9.1',
    'scipy==1.17.1',
    'matplotlib==3.11.2',
    'numpy==2.4.6',
    'etils==1.15.0',
    'absl-py==2.5.1',
    # Hugging Face checkpoints in and out (python -m hyperprompt_jax.convert),
    # read and written as numpy arrays: no PyTorch.
    'safetensors==0.8.0',
]

EXTRAS_REQUIRE = {
    # libtpu (jax[tpu]) brings the TPU compiler: the tests compile every
    # model for a TPU slice on a machine without one (jax still runs on
    # the CPU there).
    'test': ['pytest==9.2.0', 'pytest-xdist==3.8.0', 'jax[tpu]==0.10.2'],
    'tpu': ['jax[tpu]==0.10.2'],
    'gpu': ['jax[cuda12]==0.10.2'],
    # transformers' T5 as a second reference (tests/test_transformers_reference.py);
    # the CPU build of torch: --extra-index-url https://download.pytorch.org/whl/cpu
    'hf': ['transformers==5.18.0', 'torch==2.13.0'],
}

setuptools.setup(
    name='hyperprompt_jax',
    version='0.2.0',
    description=(
        'HyperPrompt and HyperGrid multi-task T5 in JAX / Flax, for t5x and '
        'a built-in runner.'
    ),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.11',
    # The top-level `tasks/` and `gin/` folders install inside the package:
    # as `hyperprompt_jax.tasks` and `hyperprompt_jax/gin` (no top-level
    # module named `tasks`).
    packages=[
        'hyperprompt_jax',
        *(f'hyperprompt_jax.{p}' for p in (
            't5', 'methods', 'model', 'common', 'training', 'checkpointing',
            'runner', 'evaluation', 'task_params', 't5x', 'benchmarks', 'huggingface')),
        'hyperprompt_jax.tasks',
        'hyperprompt_jax.gin',
    ],
    package_dir={
        'hyperprompt_jax': 'hyperprompt_jax',
        'hyperprompt_jax.tasks': 'tasks',
        'hyperprompt_jax.gin': 'gin',
    },
    package_data={
        'hyperprompt_jax.evaluation': ['paper_results.json'],
        'hyperprompt_jax.gin': ['*.gin', '*/*.gin', '*/*/*.gin'],
        'hyperprompt_jax.tasks': ['fixtures/*', 'fixtures/*/*'],
    },
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    license='Apache-2.0',
)
