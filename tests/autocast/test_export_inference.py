"""Inference export: the JAX counterpart of torch's "CPU Inference Example with Jit Trace".

torch traces a model under ``torch.autocast`` with ``torch.jit.trace`` and runs the traced module;
in JAX, ``jax.export.export(jax.jit(jaxamp.autocast(model_fn, ...)))`` captures the autocast
program as StableHLO, ``serialize()`` turns it into bytes, and ``jax.export.deserialize`` gives
back something callable with neither jaxamp nor the model's code. The round trip must give the same
bits as calling the autocast function directly, with the low dtype visible in the module text. A
CUDA export is produced here too (it cannot run on this CPU-only machine).

See ``docs/inference_export.md``.
"""

import functools
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxamp


class TorchExampleModel(nn.Module):
  """torch's example model (one ``nn.Linear``), with a hidden layer and log-softmax added."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32, name="fc1")(x))
    return jax.nn.log_softmax(nn.Dense(self.num_classes, name="fc2")(h), axis=-1)


MODEL = TorchExampleModel()
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), jnp.float32)
VARIABLES = MODEL.init(jax.random.key(0), X)
LOW_DTYPE = {"cpu": "bf16", "cuda": "f16"}


def inference_fn(device_type):
  return jax.jit(jaxamp.autocast(MODEL.apply, device_type=device_type))


@functools.cache
def exported(device_type, platforms):
  return export.export(inference_fn(device_type), platforms=platforms)(VARIABLES, X)


def round_trip(exp):
  return export.deserialize(exp.serialize())


def dot_types(module_text):
  """The element types of each ``stablehlo.dot_general``'s operands and result."""
  lines = [line for line in module_text.splitlines() if "= stablehlo.dot_general" in line]
  return [re.findall(r"tensor<(?:[0-9]+x)*(\w+)>", line.rsplit(" : ", 1)[1]) for line in lines]


def assert_bitwise_equal(actual, expected):
  assert actual.dtype == expected.dtype and actual.shape == expected.shape
  np.testing.assert_array_equal(
    np.asarray(actual).view(np.uint8), np.asarray(expected).view(np.uint8)
  )


@pytest.mark.slow
def test_serialized_cpu_export_runs_bitwise_like_the_autocast_function():
  restored = round_trip(exported("cpu", ("cpu",)))
  assert_bitwise_equal(restored.call(VARIABLES, X), inference_fn("cpu")(VARIABLES, X))


def test_serialized_export_keeps_the_signature_with_low_precision_outputs():
  restored = round_trip(exported("cpu", ("cpu",)))
  assert restored.platforms == ("cpu",)
  assert [a.dtype for a in restored.in_avals] == [jnp.float32] * 5  # 4 params, x
  assert restored.out_avals[0].dtype == inference_fn("cpu")(VARIABLES, X).dtype


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_exported_module_text_shows_the_policys_low_dtype_in_every_dot(device_type):
  text = exported(device_type, (device_type,)).mlir_module()
  low = LOW_DTYPE[device_type]
  assert dot_types(text) == [[low, low, low]] * 2  # fc1 and fc2, operands and results


def test_cuda_export_is_produced_and_serialized_on_a_cpu_only_machine():
  restored = round_trip(exported("cuda", ("cuda",)))
  assert restored.platforms == ("cuda",)
  assert restored.mlir_module() == exported("cuda", ("cuda",)).mlir_module()
  with pytest.raises(
    ValueError,
    match=r"exported for platforms '\('cuda',\)' but it is used on "
    r"'\('cpu',\)'",
  ):
    restored.call(VARIABLES, X)


@pytest.mark.slow
def test_one_export_for_cpu_and_cuda_runs_the_cuda_policy_here_bitwise():
  restored = round_trip(exported("cuda", ("cpu", "cuda")))
  assert restored.platforms == ("cpu", "cuda")
  assert_bitwise_equal(restored.call(VARIABLES, X), inference_fn("cuda")(VARIABLES, X))


@pytest.mark.slow
def test_export_with_weights_baked_in_like_torch_jit_freeze():
  frozen = jax.jit(lambda x: jaxamp.autocast(MODEL.apply, device_type="cpu")(VARIABLES, x))
  restored = round_trip(export.export(frozen)(X))
  assert [a.shape for a in restored.in_avals] == [X.shape]
  assert_bitwise_equal(restored.call(X), frozen(X))
  # Constant weights compile differently from weight arguments (XLA folds and fuses them), so
  # the frozen program is bitwise its own, and equal to the other one only up to bfloat16 rounding.
  np.testing.assert_allclose(
    np.asarray(restored.call(X), np.float32),
    np.asarray(inference_fn("cpu")(VARIABLES, X), np.float32),
    rtol=2**-7,
    atol=2**-7,
  )


_LOAD_SCRIPT = """
import json, sys, numpy as np, jax
from jax import export
restored = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
args = np.load(sys.argv[2], allow_pickle=False)
leaves = [args[f"a{i}"] for i in range(len(args.files))]
call_args, call_kwargs = jax.tree.unflatten(restored.in_tree, leaves)  # the tree is serialized too
out = np.asarray(restored.call(*call_args, **call_kwargs))
np.save(sys.argv[3], out.view(np.uint8))
print(json.dumps({"jaxamp": "jaxamp" in sys.modules, "flax": "flax" in sys.modules}))
"""


@pytest.mark.slow
def test_serialized_export_runs_in_a_process_without_jaxamp_or_flax(tmp_path):
  blob, inputs = tmp_path / "model.jax", tmp_path / "inputs.npz"
  blob.write_bytes(exported("cpu", ("cpu",)).serialize())
  leaves = jax.tree.leaves((VARIABLES, X))
  np.savez(inputs, **{f"a{i}": np.asarray(x) for i, x in enumerate(leaves)})
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", _LOAD_SCRIPT, str(blob), str(inputs), str(tmp_path / "out.npy")],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {"jaxamp": False, "flax": False}
  expected = np.asarray(inference_fn("cpu")(VARIABLES, X))
  np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected.view(np.uint8))


@pytest.mark.slow
def test_export_with_a_symbolic_batch_dimension():
  (batch,) = export.symbolic_shape("batch")
  spec = jax.ShapeDtypeStruct((batch, 16), jnp.float32)
  restored = round_trip(export.export(inference_fn("cpu"))(VARIABLES, spec))
  for n in (1, 7):
    x = jnp.ones((n, 16), jnp.float32)
    assert_bitwise_equal(restored.call(VARIABLES, x), inference_fn("cpu")(VARIABLES, x))


class _FlattenThenHeads(nn.Module):
  """A conv net that flattens its batch (``x.reshape(x.shape[0], -1)``) and splits heads."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3))(x).reshape(x.shape[0], -1)
    h = nn.Dense(8)(x).reshape(x.shape[0], 2, 4)
    return jax.nn.softmax(h, axis=-1).sum(-1)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_reshapes_of_a_symbolic_batch_export(device_type):
  model = _FlattenThenHeads()
  variables = model.init(jax.random.key(0), jnp.ones((1, 6, 6, 3)))
  fn = jax.jit(jaxamp.autocast(model.apply, device_type=device_type))
  (batch,) = export.symbolic_shape("batch")
  spec = jax.ShapeDtypeStruct((batch, 6, 6, 3), jnp.float32)
  restored = round_trip(export.export(fn, platforms=("cpu",))(variables, spec))
  for n in (1, 3):
    x = jnp.asarray(np.random.default_rng(n).standard_normal((n, 6, 6, 3)), jnp.float32)
    assert_bitwise_equal(restored.call(variables, x), fn(variables, x))


def _causal_scores(x, w):
  h = x @ w
  causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
  return (
    jnp.where(causal, h @ h.T, -1e9)
    + jnp.zeros(x.shape[0])
    - jnp.broadcast_to(x[:, :1], causal.shape)
  )


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_broadcasts_to_a_symbolic_size_export(device_type):
  w = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)
  fn = jax.jit(jaxamp.autocast(_causal_scores, device_type=device_type))
  (batch,) = export.symbolic_shape("batch")
  spec = jax.ShapeDtypeStruct((batch, 8), jnp.float32)
  restored = round_trip(export.export(fn, platforms=("cpu",))(spec, w))
  for n in (1, 3):  # XLA compiles a size-1 dot of static shapes apart: close, not bitwise
    x = jnp.asarray(np.random.default_rng(n).standard_normal((n, 8)), jnp.float32)
    actual, expected = restored.call(x, w), fn(x, w)
    assert actual.dtype == expected.dtype
    np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2)


def test_a_parameter_broadcast_to_a_symbolic_size_exports_its_float32_gradient():
  (batch,) = export.symbolic_shape("batch")
  loss = jaxamp.autocast(
    lambda b, x: ((x + jnp.broadcast_to(b, x.shape)) @ x.T).astype(jnp.float32).sum(),
    device_type="cuda",
  )
  grad = jax.jit(jax.grad(loss))
  b = jnp.ones((8,), jnp.float32)
  restored = round_trip(
    export.export(grad, platforms=("cpu",))(b, jax.ShapeDtypeStruct((batch, 8), jnp.float32))
  )
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8)), jnp.float32)
  assert_bitwise_equal(restored.call(b, x), grad(b, x))


_both_tanh = jaxamp.register_op("test_export.both_tanh", category="float32_inside")(
  lambda a, b: (jnp.tanh(a), jnp.tanh(b))
)


@pytest.mark.parametrize("symbolic_first", [True, False])
def test_an_op_given_a_symbolic_and_a_static_input_exports(symbolic_first):
  def fun(x, w):
    a, b = (x @ w)[:, 0], w[0, :4] @ w[:4, :4]
    return _both_tanh(a, b) if symbolic_first else _both_tanh(b, a)

  (batch,) = export.symbolic_shape("batch")
  spec = jax.ShapeDtypeStruct((batch, 8), jnp.float32)
  exp = export.export(jax.jit(jaxamp.autocast(fun, device_type="cuda")))(spec, jnp.ones((8, 8)))
  assert {aval.dtype for aval in exp.out_avals} == {jnp.dtype(jnp.float16)}
