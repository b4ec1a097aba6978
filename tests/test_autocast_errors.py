"""Bad input to the autocast API gets a clear error naming the valid choices."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp._src import policy


def test_unknown_device_type_names_the_choices():
  with pytest.raises(ValueError, match=r"`device_type` must be one of \('cpu', 'cuda'"):
    jaxamp.autocast(lambda x: x, device_type="mps")


@pytest.mark.parametrize("device_type", ["gpu", "rocm", "cuda"])
def test_jax_gpu_platform_names_are_the_cuda_policy(device_type):
  assert jaxamp.is_autocast_available(device_type)
  assert jaxamp.get_autocast_dtype(device_type) == jnp.float16
  fun = jaxamp.autocast(lambda x: x @ x, device_type=device_type)
  assert fun(jnp.ones((2, 2))).dtype == jnp.float16
  assert jaxamp.explain(lambda x: x @ x, device_type=device_type)(jnp.ones((2, 2)))


def test_an_unknown_device_type_error_says_which_platform_maps_to_which_policy():
  with pytest.raises(ValueError) as error:
    jaxamp.autocast(lambda x: x, device_type="metal")
  message = str(error.value)
  assert 'gpu, rocm -> "cuda"' in message and 'cpu -> "cpu"' in message
  assert "got 'metal'" in message
  assert not jaxamp.is_autocast_available("metal")


@pytest.mark.parametrize(
  "backend, device_type",
  [("gpu", "cuda"), ("cuda", "cuda"), ("rocm", "cuda"), ("cpu", "cpu"), ("metal", "cpu")],
)
def test_the_default_device_type_maps_jaxs_backend(monkeypatch, backend, device_type):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert policy.default_device_type() == device_type


def test_a_registered_table_is_its_own_platforms_policy(monkeypatch):
  table = policy.get_table("cpu")
  monkeypatch.setitem(policy._TABLES, "npu", table)
  assert jaxamp.is_autocast_available("npu") and policy.get_table("npu") is table
  assert 'npu -> "npu"' in policy._platforms()


@pytest.mark.parametrize("device_type", ["cuda", None])
def test_autocast_as_a_context_manager_is_a_type_error_showing_both_spellings(device_type):
  with pytest.raises(TypeError) as error:
    with jaxamp.autocast(device_type=device_type):
      pass
  message = str(error.value)
  assert "function transformation" in message
  assert 'jaxamp.autocast(f, device_type="cuda")' in message
  assert '@jaxamp.autocast(device_type="cuda")' in message
  assert "jaxamp.autocast_disabled()" in message


def test_autocast_without_a_function_is_a_decorator():
  @jaxamp.autocast(device_type="cuda")
  def matmul(x):
    return x @ x

  assert matmul(jnp.ones((2, 2))).dtype == jnp.float16


def test_non_string_device_type_is_a_type_error():
  with pytest.raises(TypeError, match="`device_type` must be a string"):
    jaxamp.autocast(lambda x: x, device_type=3)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.float64, "float8", object()])
def test_unsupported_dtype_names_the_choices(dtype):
  with pytest.raises(ValueError, match="`dtype` must be one of jnp.float16 or jnp.bfloat16"):
    jaxamp.autocast(lambda x: x, device_type="cuda", dtype=dtype)


def test_non_callable_is_a_type_error():
  with pytest.raises(TypeError, match="autocast transforms a callable"):
    jaxamp.autocast(3, device_type="cuda")


def test_non_bool_enabled_is_a_type_error():
  with pytest.raises(TypeError, match="`enabled` must be a bool"):
    jaxamp.autocast(lambda x: x, enabled="yes")


def test_get_autocast_dtype_of_unknown_device_type():
  with pytest.raises(ValueError, match="`device_type` must be one of"):
    jaxamp.get_autocast_dtype("mps")


def test_custom_fwd_rejects_a_non_float_cast():
  with pytest.raises(ValueError, match="`cast_inputs` must be one of"):
    jaxamp.custom_fwd(cast_inputs=jnp.int8)(lambda x: x)


def test_register_op_rejects_an_unknown_category():
  with pytest.raises(ValueError, match="`category` must be one of"):
    jaxamp.register_op("x", category="fp8")
