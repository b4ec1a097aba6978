"""Bad input to the autocast API gets a clear error naming the valid choices."""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp._src.policies import policy


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


def test_torch_spelling_with_the_device_type_first_is_a_decorator():
  @jaxamp.autocast("cuda")
  def matmul(x):
    return x @ x

  assert matmul(jnp.ones((2, 2))).dtype == jnp.float16


def test_torch_spelling_equals_the_keyword_spelling_bit_for_bit():
  x = jax.random.normal(jax.random.key(0), (8, 8))
  f = lambda x: jnp.tanh(x @ x.T).sum(-1)  # noqa: E731
  torch_style = jaxamp.autocast("cuda")(f)(x)
  keyword = jaxamp.autocast(f, device_type="cuda")(x)
  assert torch_style.dtype == keyword.dtype and torch_style.tobytes() == keyword.tobytes()


def test_torch_spelling_decorator_takes_a_dtype():
  @jaxamp.autocast("cuda", dtype=jnp.bfloat16)
  def matmul(x):
    return x @ x

  assert matmul(jnp.ones((2, 2))).dtype == jnp.bfloat16


def test_torch_spelling_with_an_agreeing_device_type_keyword_is_accepted():
  assert jaxamp.autocast("cpu", device_type="cpu")(lambda x: x @ x)(jnp.ones((2, 2))).dtype == (
    jnp.bfloat16
  )


def test_torch_spelling_with_a_disagreeing_device_type_keyword_is_a_type_error():
  with pytest.raises(TypeError, match="two device types"):
    jaxamp.autocast("cuda", device_type="cpu")


def test_torch_spelling_with_a_misspelt_device_type_names_the_valid_ones():
  with pytest.raises(ValueError, match=r"`device_type` must be one of \('cpu', 'cuda'.*got 'cdua'"):
    jaxamp.autocast("cdua")


def test_torch_spelling_as_a_context_manager_is_the_same_type_error():
  messages = []
  for make in (lambda: jaxamp.autocast("cuda"), lambda: jaxamp.autocast(device_type="cuda")):
    with pytest.raises(TypeError, match="function transformation") as error:
      with make():
        pass
    messages.append(str(error.value))
  assert messages[0] == messages[1]


def test_help_of_autocast_lists_every_device_type_with_its_default_dtype():
  doc = " ".join(jaxamp.autocast.__doc__.split())
  assert '"cuda" (also "gpu", "rocm")' in doc
  for device_type in policy.device_types():
    dtype = jaxamp.get_autocast_dtype(device_type).name
    assert re.search(rf'"{device_type}" (\(also [^)]*\) )?{dtype}', doc), device_type


@pytest.mark.parametrize(
  "name, spelling",
  [
    ("GradScaler", r"jaxamp\.dynamic_loss_scale\(optax.*jaxamp\.scale_loss.*jaxamp\.scaler"),
    ("amp", r"jaxamp is itself torch\.amp: `jaxamp\.autocast`.*`jaxamp\.dynamic_loss_scale`"),
    ("cuda", r'jaxamp\.autocast\(f, device_type="cuda"\)'),
  ],
)
def test_torch_names_raise_an_attribute_error_naming_the_jax_spelling(name, spelling):
  with pytest.raises(
    AttributeError, match=rf"module 'jaxamp' has no attribute '{name}': .*{spelling}"
  ):
    getattr(jaxamp, name)
  assert not hasattr(jaxamp, name)


def test_other_missing_names_raise_the_usual_attribute_error():
  with pytest.raises(AttributeError, match=r"^module 'jaxamp' has no attribute 'GradScalar'$"):
    jaxamp.GradScalar  # noqa: B018


def test_non_string_device_type_is_a_type_error():
  with pytest.raises(TypeError, match="`device_type` must be a string"):
    jaxamp.autocast(lambda x: x, device_type=3)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.float64, "float8", object()])
def test_unsupported_dtype_names_the_choices(dtype):
  valid = "`dtype` must be one of jnp.float16, jnp.bfloat16 or jnp.float8_e4m3fn"
  with pytest.raises(ValueError, match=valid):
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
