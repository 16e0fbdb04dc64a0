"""The TPU kernels' acceptance command (`benchmarks/kernel_acceptance.py`):
end to end on this host, the kernels in Pallas's interpreter at a tiny
size, and compiled for TPU v3 (the least VMEM) at Base from libtpu."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hyperprompt_jax.benchmarks import kernel_acceptance

import conftest

needs_libtpu = conftest.needs_libtpu


def _command(*flags: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu', TPU_SKIP_MDS_QUERY='1',
             ALLOW_MULTIPLE_LIBTPU_LOAD='1')
  if '--compile' in flags:
    # TPU programs stay out of the session's cache of CPU programs; the
    # CPU run shares it (its checks' and timed steps' parameters are one
    # program, compiled once).
    env.pop('JAX_COMPILATION_CACHE_DIR', None)
  return subprocess.run(
      [sys.executable, '-m', 'hyperprompt_jax.benchmarks.kernel_acceptance',
       *flags], env=env, capture_output=True, text=True, timeout=900,
      check=False)


def test_acceptance_runs_at_a_tiny_size(tmp_path):
  """(a) a kernel test in its own process, (b) the kernel form against the
  XLA form, (c) both forms' steps timed, (d) MFU (none on a CPU: no peak);
  the JSON has them all. One layer a stack: HyperGrid's kernels run in an
  encoder and a decoder layer, as in more."""
  out = tmp_path / 'kernels.json'
  run = _command(
      '--model=t5_1_1_tiny', '--num_layers=1', '--batch_size=2',
      '--input_length=32', '--target_length=8', '--variants=hypergrid_lg',
      '--checks=float32', '--steps=1', '--warmup_steps=0',
      f'--output_json={out}',
      '--tests=per_task_matmul_matches_numpy_token_by_token and 20-32-24')
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report['passed'] and report['platform'] == 'cpu'
  assert report['num_layers'] == 1
  assert report['tests']['status'] == 'passed', report['tests']
  assert '1 passed' in report['tests']['summary']
  entry = report['variants']['hypergrid_lg']
  forms = entry['forms']['float32']
  assert forms['passed'] and forms['kernel_loss'] > 0
  assert forms['loss'] <= 1e-4 and forms['worst'] <= 1e-3
  for form in ('blockwise', 'pallas'):
    row = entry['timing'][form]
    assert row['seconds_per_step'] > 0 and row['mfu'] is None
  assert 'PASSED' in run.stdout


def test_differences_judge_each_parameter_and_all():
  grads = {'a': np.array([1.0, 0.0]), 'b': np.array([0.0, 3.0])}
  got = {'a': np.array([1.0, 0.1]), 'b': np.array([0.0, 3.0])}
  diff = kernel_acceptance.differences(2.2, got, 2.0, grads)
  assert diff['loss'] == pytest.approx(0.1)
  assert diff['worst'] == pytest.approx(0.1)
  assert diff['worst_parameter'] == "['a']"
  assert diff['global'] == pytest.approx(0.1 / np.sqrt(10))


def test_kernel_vmem_reads_the_compiler_s_allocation():
  line = ('  %custom-call.3 = (f32[2048,768]{1,0}, f32[4,1,4,9,32,32]{5,4,3,2,'
          '1,0}) custom-call(%a, %b), custom_call_target="tpu_custom_call", '
          'metadata={op_name="jit(loss)/transpose(jvp())/pallas_call"}, '
          'backend_config={"used_scoped_memory_configs":[{"memory_space":'
          '"1","offset":"0","size":"4677632"}]}')
  assert kernel_acceptance.kernel_vmem(f'%x = f32[] add()\n{line}\n') == [{
      'pass': 'backward', 'result': '(f32[2048,768], f32[4,1,4,9,32,32])',
      'vmem_bytes': 4677632}]


@needs_libtpu
def test_kernels_compile_for_tpu_v3_at_base(tmp_path):
  """HyperGrid's wo (T5.1.1-Base and T5 v1.0 Base) and the adapter's
  kernels, a Base device batch (4 rows of 512, bfloat16), compile for TPU
  v3, whose TensorCore has 16 MiB of VMEM (the least of v3 - v6e; the
  others are compiled by the command's defaults, docs/performance.md)."""
  out = tmp_path / 'vmem.json'
  run = _command('--compile', '--topologies=v3:2x2',
                 '--cases=hypergrid_wo,adapter',
                 '--backbones=t5_1_1_base,t5_base', f'--output_json={out}')
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  report = json.loads(out.read_text())
  (generation,) = report['generations']
  assert generation['device_kind'] == 'TPU v3'
  assert generation['vmem_mib'] == 16
  assert [(c['case'], c['backbone']) for c in generation['cases']] == [
      ('hypergrid_wo', 't5_1_1_base'), ('hypergrid_wo', 't5_base'),
      ('adapter', 't5_1_1_base')]
  for case in generation['cases']:
    assert 'error' not in case, case
    # Forward and backward: HyperGrid 3 kernels, the adapter 2 matmuls.
    assert len(case['kernels']) in (3, 6), case['kernels']
    for kernel in case['kernels']:
      assert 0 < kernel['vmem_bytes'] <= 16 * kernel_acceptance.MIB, case
